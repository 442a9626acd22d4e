# Writes build_info.inc (commit, dirty flag, compilers) into the build tree at every build; the file is
# rewritten only when its content changes, so a rebuild happens only after a new commit.
# Run as a script: cmake -DSOURCE_DIR=... -DOUTPUT=... -DCXX_ID=... -DCUDA_ID=... -P BuildInfo.cmake
# .decodelab-commit, when present, wins: the GPU machine receives a copy of the tree whose own git
# metadata (if any) is not this checkout's, so tools/device/*.sh callers write the commit there before
# sending the tree ("<12 hex>" or "<12 hex>-dirty"; tools/device/README.md). Otherwise: git.
set(dirty "false")
if(EXISTS ${SOURCE_DIR}/.decodelab-commit)
  file(STRINGS ${SOURCE_DIR}/.decodelab-commit commit LIMIT_COUNT 1)
  if(commit MATCHES "-dirty$")
    string(REGEX REPLACE "-dirty$" "" commit "${commit}")
    set(dirty "true")
  endif()
else()
  execute_process(COMMAND git -C ${SOURCE_DIR} rev-parse --short=12 HEAD
                  OUTPUT_VARIABLE commit OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0 OR commit STREQUAL "")
    set(commit "unknown")
  else()
    execute_process(COMMAND git -C ${SOURCE_DIR} status --porcelain --untracked-files=no
                    OUTPUT_VARIABLE status OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(NOT status STREQUAL "")
      set(dirty "true")
    endif()
  endif()
endif()
set(content "#define DECODELAB_GIT_COMMIT \"${commit}\"\n#define DECODELAB_GIT_DIRTY ${dirty}\n#define DECODELAB_CXX_COMPILER \"${CXX_ID}\"\n#define DECODELAB_CUDA_COMPILER \"${CUDA_ID}\"\n")
if(EXISTS ${OUTPUT})
  file(READ ${OUTPUT} old)
else()
  set(old "")
endif()
if(NOT old STREQUAL content)
  file(WRITE ${OUTPUT} "${content}")
endif()
