// The README and docs/ link only to files that ship with the repository (a reader of a checkout or a
// release has nothing else), and name no design notes kept outside it.
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace dl {
namespace {

namespace fs = std::filesystem;

std::vector<fs::path> Docs() {
  const fs::path root = DECODELAB_SOURCE_DIR;
  std::vector<fs::path> files = {root / "README.md"};
  for (const auto& e : fs::recursive_directory_iterator(root / "docs")) {
    if (e.path().extension() == ".md") files.push_back(e.path());
  }
  for (const char* dir : {"tools", "suites"}) {
    if (!fs::exists(root / dir)) continue;
    for (const auto& e : fs::recursive_directory_iterator(root / dir)) {
      if (e.path().filename() == "README.md" && e.path().string().find("node_modules") == std::string::npos) {
        files.push_back(e.path());
      }
    }
  }
  return files;
}

std::string Read(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(DocsTest, EveryRelativeLinkResolves) {
  const std::regex link(R"(\]\(([^)\s]+)\))");
  int checked = 0;
  for (const fs::path& doc : Docs()) {
    const std::string text = Read(doc);
    for (auto it = std::sregex_iterator(text.begin(), text.end(), link); it != std::sregex_iterator(); ++it) {
      std::string target = (*it)[1];
      if (target.rfind("http://", 0) == 0 || target.rfind("https://", 0) == 0 || target[0] == '#') continue;
      target = target.substr(0, target.find('#'));
      EXPECT_TRUE(fs::exists(doc.parent_path() / target))
          << doc.string() << " links to " << target << ", which does not ship";
      ++checked;
    }
  }
  EXPECT_GT(checked, 5);
}

TEST(DocsTest, NoDesignNotesFromOutsideTheRepository) {
  for (const fs::path& doc : Docs()) {
    const std::string text = Read(doc);
    for (const char* name : {"shared/design", "design/", "laguna-architecture.md", "laguna-checkpoints.md",
                             "perf-anchors.md", "ecosystem.md", "METHOD.md"}) {
      EXPECT_EQ(text.find(name), std::string::npos) << doc.string() << " names " << name;
    }
  }
}

}  // namespace
}  // namespace dl
