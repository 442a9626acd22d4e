# Run at build time (cmake -P) by the dl_report_bundles target (src/lab/CMakeLists.txt): installs
# the pinned Vega-Lite bundles with `npm ci --ignore-scripts` in a build-tree copy of this folder
# (never in the source tree) and copies the three UMD bundles to OUT_DIR, where `decodelab lab
# report` finds them (<bin>/../share/decodelab/report). Never fails the build: without npm or a
# registry the report still writes its tables and says the charts are missing.
# Inputs: SRC_DIR (this folder), WORK_DIR (build-tree copy), OUT_DIR, STAMP.
set(bundles vega/build/vega.min.js vega-lite/build/vega-lite.min.js
  vega-embed/build/vega-embed.min.js)
file(MAKE_DIRECTORY "${WORK_DIR}" "${OUT_DIR}")
file(COPY "${SRC_DIR}/package.json" "${SRC_DIR}/package-lock.json" DESTINATION "${WORK_DIR}")

set(have_all TRUE)
foreach(b IN LISTS bundles)
  if(NOT EXISTS "${WORK_DIR}/node_modules/${b}")
    set(have_all FALSE)
  endif()
endforeach()
# A changed lockfile means other versions: install again.
if(have_all AND EXISTS "${WORK_DIR}/node_modules/.package-lock.json"
   AND "${SRC_DIR}/package-lock.json" IS_NEWER_THAN "${WORK_DIR}/node_modules/.package-lock.json")
  set(have_all FALSE)
endif()

if(NOT have_all)
  find_program(NPM_EXE npm)
  if(NOT NPM_EXE)
    message(WARNING "report bundles: npm not found; `lab report` will write tables without charts")
  else()
    message(STATUS "report bundles: npm ci --ignore-scripts in ${WORK_DIR}")
    execute_process(COMMAND "${NPM_EXE}" ci --ignore-scripts --no-audit --no-fund --fetch-retries=1
      WORKING_DIRECTORY "${WORK_DIR}" RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out
      TIMEOUT 300)
    if(NOT rc EQUAL 0)
      message(WARNING "report bundles: npm ci failed (${rc}); `lab report` will write tables "
        "without charts:\n${out}")
    endif()
  endif()
endif()

set(copied 0)
foreach(b IN LISTS bundles)
  if(EXISTS "${WORK_DIR}/node_modules/${b}")
    file(COPY "${WORK_DIR}/node_modules/${b}" DESTINATION "${OUT_DIR}")
    math(EXPR copied "${copied} + 1")
  endif()
endforeach()
# The stamp only when all three are there, so a later build retries a failed install.
if(copied EQUAL 3)
  file(WRITE "${STAMP}" "bundles copied: ${copied}\n")
else()
  file(REMOVE "${STAMP}")
endif()
