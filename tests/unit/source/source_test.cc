// Model sources (source/): the s3:// uri, S3's listing XML as a hostile server may send it, the
// cache's rules for what a listing may name, spec.model.files, the listing's content address and
// the environment the AWS tools read; oci:// and a registry's manifest. The fetches themselves run
// against a real S3 server in cli.model_source.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>

#include "absl/strings/str_cat.h"
#include "api/sharded_model.h"
#include "model/test_models.h"
#include "source/hf.h"
#include "source/model_cache.h"
#include "source/model_source.h"
#include "source/oci.h"
#include "source/s3.h"

namespace shardserve::source {
namespace {

using ::testing::HasSubstr;

std::string Why(const absl::Status& s) { return std::string(s.message()); }

TEST(ModelUriTest, S3UrisNameABucketAndAPrefix) {
  auto u = ParseModelUri("s3://models/llama/8b/");
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ(u->scheme, ModelUri::Scheme::kS3);
  EXPECT_EQ(u->bucket, "models");
  EXPECT_EQ(u->path, "llama/8b");
  EXPECT_TRUE(u->remote());
  EXPECT_EQ(ParseModelUri("s3://models")->path, "");
  EXPECT_THAT(Why(ParseModelUri("s3://").status()), HasSubstr("names no bucket"));
  EXPECT_THAT(Why(ParseModelUri("s3://Bad_Bucket/x").status()), HasSubstr("names no bucket"));
  EXPECT_THAT(Why(ParseModelUri("s3://models/../etc").status()), HasSubstr("'..'"));
  EXPECT_FALSE(ParseModelUri("file:///m")->remote());
}

TEST(ModelUriTest, FilesAreForRemoteModelsOnly) {
  auto m = ParseShardedModel(R"(apiVersion: shardserve.io/v1alpha1
kind: ShardedModel
metadata: {name: m}
spec:
  model: {name: m, uri: "file:///models/m", files: ["*.json"]}
  worker: {image: w}
)");
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(Why(m.status()), HasSubstr("spec.model.files chooses which files of a remote model"));
  auto s3 = ParseShardedModel(R"(apiVersion: shardserve.io/v1alpha1
kind: ShardedModel
metadata: {name: m}
spec:
  model: {name: m, uri: "s3://models/m", files: ["*.json", "*.safetensors"]}
  worker: {image: w}
)");
  ASSERT_TRUE(s3.ok()) << s3.status();
  EXPECT_EQ(s3->spec.model_files, (std::vector<std::string>{"*.json", "*.safetensors"}));
}

TEST(S3Test, ReadsAListingPageAndItsContinuation) {
  auto page = ParseS3Listing(R"(<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">
  <Name>models</Name><Prefix>llama/</Prefix><IsTruncated>true</IsTruncated>
  <NextContinuationToken>abc==</NextContinuationToken>
  <Contents><Key>llama/config.json</Key><Size>512</Size>
    <ETag>&quot;0123456789abcdef0123456789abcdef&quot;</ETag></Contents>
  <Contents><Key>llama/model.safetensors</Key><Size>1073741824</Size>
    <ETag>"9b2cf535f27731c974343645a3985328-64"</ETag></Contents>
</ListBucketResult>)",
                             "s3://models/llama");
  ASSERT_TRUE(page.ok()) << page.status();
  ASSERT_EQ(page->objects.size(), 2u);
  EXPECT_EQ(page->objects[0].key, "llama/config.json");
  EXPECT_EQ(page->objects[0].etag, "0123456789abcdef0123456789abcdef");
  EXPECT_EQ(page->objects[1].size, int64_t{1} << 30);
  EXPECT_EQ(page->next_token, "abc==");
}

TEST(S3Test, AListingThatIsNotOneIsNamed) {
  for (const char* body :
       {"", "not xml", "<Error><Code>AccessDenied</Code></Error>",
        "<ListBucketResult><Contents><Key>a</Key><Size>-1</Size></Contents></ListBucketResult>",
        "<ListBucketResult><Contents><Size>1</Size></Contents></ListBucketResult>",
        "<ListBucketResult><IsTruncated>true</IsTruncated></ListBucketResult>",
        // An entity from a DTD (the billion laughs' first step) is not expanded.
        "<!DOCTYPE l [<!ENTITY a \"aaaa\">]><ListBucketResult><Contents><Key>&a;</Key>"
        "<Size>1</Size></Contents></ListBucketResult>"}) {
    auto page = ParseS3Listing(body, "s3://b/p");
    if (page.ok()) {
      for (const auto& o : page->objects) EXPECT_NE(o.key, "aaaa") << body;
      continue;
    }
    EXPECT_THAT(Why(page.status()), HasSubstr("s3://b/p: ")) << body;
  }
}

TEST(S3Test, OptionsFromTheEnvironmentEveryAwsToolReads) {
  std::map<std::string, std::string> vars = {{"AWS_ACCESS_KEY_ID", "AKIA"},
                                             {"AWS_SECRET_ACCESS_KEY", "secret"},
                                             {"AWS_DEFAULT_REGION", "eu-west-1"},
                                             {"AWS_ENDPOINT_URL", "http://minio:9000"}};
  auto env = [&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
  auto o = S3Options::FromEnv(env);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->region, "eu-west-1");
  EXPECT_EQ(o->endpoint, "http://minio:9000");
  vars["AWS_REGION"] = "us-west-2";
  vars["AWS_ENDPOINT_URL_S3"] = "https://s3.internal";
  EXPECT_EQ(S3Options::FromEnv(env)->region, "us-west-2");
  EXPECT_EQ(S3Options::FromEnv(env)->endpoint, "https://s3.internal");
  vars["AWS_ENDPOINT_URL_S3"] = "ftp://s3.internal";
  EXPECT_THAT(Why(S3Options::FromEnv(env).status()), HasSubstr("must be an http:// or https://"));
  vars.erase("AWS_ENDPOINT_URL_S3");
  vars.erase("AWS_SECRET_ACCESS_KEY");
  EXPECT_THAT(Why(S3Options::FromEnv(env).status()), HasSubstr("go together"));
  vars["AWS_SECRET_ACCESS_KEY"] = "s";
  vars["AWS_REGION"] = "us-west-2/../x";
  EXPECT_THAT(Why(S3Options::FromEnv(env).status()), HasSubstr("is no region"));
}

RemoteFile File(const std::string& path, int64_t size = 1) {
  RemoteFile f;
  f.path = path;
  f.size = size;
  f.get.url = "http://127.0.0.1:1/" + path;  // never reached: refused before any fetch
  return f;
}

// A listing is a hostile server's word: nothing it names may land outside the model's directory
// or on the cache's own files.
TEST(ModelCacheTest, AListingCannotNameAFileOutsideItsDirectory) {
  testing::TempDir dir;
  for (const char* path : {"../escape", "a/../../escape", "/etc/passwd", "a//b", "./a", "",
                           ".manifest.json", "x.part", "x.part.done", ".lock", "a\nb", "a\\b"}) {
    auto r = Materialize(dir.path(), "s3://b/m", "k", {File(path)});
    ASSERT_FALSE(r.ok()) << path;
    EXPECT_THAT(Why(r.status()), HasSubstr("s3://b/m: the source lists a file")) << path;
  }
  auto twice = Materialize(dir.path(), "s3://b/m", "k", {File("a"), File("a")});
  EXPECT_THAT(Why(twice.status()), HasSubstr("lists a twice"));
  EXPECT_THAT(Why(Materialize(dir.path(), "s3://b/m", "../k", {File("a")}).status()),
              HasSubstr("no revision"));
  EXPECT_THAT(Why(Materialize(dir.path(), "s3://b/m", "k", {}).status()),
              HasSubstr("lists no files"));
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::path(dir.path()).parent_path() / "escape"));
}

TEST(ModelCacheTest, FilesChooseByPatternAndAPatternMatchingNothingIsNamed) {
  const std::vector<RemoteFile> all = {File("config.json"), File("model-00001.safetensors"),
                                       File("original/consolidated.pth"), File("README.md")};
  auto chosen = Choose(all, {"*.json", "*.safetensors"});
  ASSERT_TRUE(chosen.ok());
  ASSERT_EQ(chosen->size(), 2u);
  EXPECT_EQ((*chosen)[1].path, "model-00001.safetensors");
  EXPECT_EQ(Choose(all, {})->size(), 4u);
  EXPECT_EQ(Choose(all, {"*.pth"}).status().code(), absl::StatusCode::kNotFound);  // '*' stops at /
  EXPECT_THAT(Why(Choose(all, {"*.gguf"}).status()), HasSubstr("'*.gguf' matches none"));
}

TEST(ModelCacheTest, TheListingKeyFollowsWhatItListsNotItsOrder) {
  RemoteFile a = File("a", 10), b = File("b", 20);
  EXPECT_EQ(ListingKey({a, b}), ListingKey({b, a}));
  RemoteFile b2 = b;
  b2.md5 = "00";
  EXPECT_NE(ListingKey({a, b}), ListingKey({a, b2}));
  b2 = b;
  b2.size = 21;
  EXPECT_NE(ListingKey({a, b}), ListingKey({a, b2}));
  EXPECT_EQ(ListingKey({a}).size(), 64u);
}

TEST(ModelSourceTest, TheCacheRootFollowsTheEnvironment) {
  std::map<std::string, std::string> vars = {{"HOME", "/home/u"}};
  auto env = [&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
  EXPECT_EQ(DefaultCacheRoot(env), "/home/u/.cache/shardserve/models");
  vars["XDG_CACHE_HOME"] = "/xdg";
  EXPECT_EQ(DefaultCacheRoot(env), "/xdg/shardserve/models");
  vars["SHARDSERVE_MODEL_CACHE"] = "/models";
  EXPECT_EQ(DefaultCacheRoot(env), "/models");
}

TEST(ModelUriTest, HfUrisNameARepositoryAndARevision) {
  auto u = ParseModelUri("hf://meta-llama/Llama-3.1-8B-Instruct");
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ(u->scheme, ModelUri::Scheme::kHf);
  EXPECT_EQ(u->repo, "meta-llama/Llama-3.1-8B-Instruct");
  EXPECT_EQ(u->revision, "main");
  EXPECT_TRUE(u->remote());
  EXPECT_EQ(ParseModelUri("hf://Qwen/Qwen3-8B@refs/pr/3")->revision, "refs/pr/3");
  for (const char* bad : {"hf://", "hf://llama", "hf://a/b/c", "hf://a/b@", "hf://a/b@x/../y",
                          "hf://a b/c", "hf://-a/b"}) {
    EXPECT_FALSE(ParseModelUri(bad).ok()) << bad;
  }
}

TEST(HfTest, ReadsTheHubsListingAndChecksEachFile) {
  HfOptions o;
  o.endpoint = "http://hub.internal";
  o.token = "hf_x";
  const std::string sha(40, 'a'), lfs(64, 'b'), blob(40, 'c');
  auto l = ParseHfListing(absl::StrCat(R"({"id": "o/m", "sha": ")", sha, R"(", "siblings": [
      {"rfilename": "config.json", "size": 700, "blobId": ")",
                                       blob, R"("},
      {"rfilename": "model.safetensors", "size": 134, "blobId": ")",
                                       blob, R"(", "lfs": {"sha256": ")", lfs,
                                       R"(", "size": 4000000000, "pointerSize": 134}}]})"),
                          o, "o/m", "hf://o/m");
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->commit, sha);
  ASSERT_EQ(l->files.size(), 2u);
  EXPECT_EQ(l->files[0].git_sha1, blob);
  EXPECT_EQ(l->files[0].size, 700);
  EXPECT_EQ(l->files[1].sha256, lfs);
  EXPECT_EQ(l->files[1].size, 4000000000);  // the LFS object's, not the pointer's
  EXPECT_EQ(l->files[1].get.url,
            absl::StrCat("http://hub.internal/o/m/resolve/", sha, "/model.safetensors"));
  EXPECT_EQ(l->files[1].get.headers, std::vector<std::string>{"Authorization: Bearer hf_x"});
  for (const std::string& bad :
       {std::string("[]"), std::string(R"({"sha": "main", "siblings": []})"),
        absl::StrCat(R"({"sha": ")", sha, R"("})"),
        absl::StrCat(R"({"sha": ")", sha, R"(", "siblings": [{"rfilename": "a"}]})"),
        absl::StrCat(R"({"sha": ")", sha,
                     R"(", "siblings": [{"rfilename": "a", "lfs": {"sha256": "x", "size": 1}}]})"),
        absl::StrCat(R"({"sha": ")", sha, R"(", "siblings": []})")}) {
    auto r = ParseHfListing(bad, o, "o/m", "hf://o/m");
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_THAT(Why(r.status()), HasSubstr("hf://o/m: ")) << bad;
  }
}

TEST(ModelUriTest, OciUrisNameARegistryARepositoryAndATagOrDigest) {
  auto u = ParseModelUri("oci://registry.example.com:5000/team/models/llama-3:v1.2");
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ(u->scheme, ModelUri::Scheme::kOci);
  EXPECT_EQ(u->registry, "registry.example.com:5000");
  EXPECT_EQ(u->repo, "team/models/llama-3");
  EXPECT_EQ(u->revision, "v1.2");
  EXPECT_TRUE(u->remote());
  EXPECT_EQ(ParseModelUri("oci://ghcr.io/o/m")->revision, "latest");
  const std::string digest = absl::StrCat("sha256:", std::string(64, 'a'));
  EXPECT_EQ(ParseModelUri(absl::StrCat("oci://ghcr.io/o/m@", digest))->revision, digest);
  for (const std::string bad : {"oci://", "oci://ghcr.io", "oci://ghcr.io/", "oci://ghcr.io/Upper",
                                "oci://ghcr.io/o/m:", "oci://ghcr.io/o/m@sha256:xyz",
                                "oci://ghcr.io/o/../m", "oci://-x.io/o/m", "oci://ghcr.io/o//m"}) {
    EXPECT_FALSE(ParseModelUri(bad).ok()) << bad;
  }
}

TEST(OciTest, ReadsAnArtifactsManifestOneLayerAFile) {
  const std::string a(64, 'a'), b(64, 'b');
  auto files =
      ParseOciManifest(absl::StrCat(R"({"schemaVersion": 2,
      "mediaType": "application/vnd.oci.image.manifest.v1+json",
      "config": {"mediaType": "application/vnd.oci.empty.v1+json", "digest": "sha256:x", "size": 2},
      "layers": [
        {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": "sha256:)",
                                    a, R"(", "size": 700,
         "annotations": {"org.opencontainers.image.title": "config.json"}},
        {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": "sha256:)",
                                    b, R"(", "size": 4000000000,
         "annotations": {"org.opencontainers.image.title": "model.safetensors"}}]})"),
                       "https://r.io/v2/o/m/blobs/", "Authorization: Bearer t", "oci://r.io/o/m");
  ASSERT_TRUE(files.ok()) << files.status();
  ASSERT_EQ(files->size(), 2u);
  EXPECT_EQ((*files)[1].path, "model.safetensors");
  EXPECT_EQ((*files)[1].size, 4000000000);
  EXPECT_EQ((*files)[1].sha256, b);
  EXPECT_EQ((*files)[1].get.url, absl::StrCat("https://r.io/v2/o/m/blobs/sha256:", b));
  EXPECT_EQ((*files)[1].get.headers, std::vector<std::string>{"Authorization: Bearer t"});
  const std::string layer = absl::StrCat(R"({"digest": "sha256:)", a, R"(", "size": 1)");
  for (const auto& [bad, why] : std::vector<std::pair<std::string, std::string>>{
           {"[]", "is not a JSON object"},
           {R"({"mediaType": "application/vnd.oci.image.index.v1+json", "manifests": []})",
            "an index of images"},
           {R"({"layers": {}})", "lists no layers"},
           // Types a hostile registry may send where strings belong: named, never thrown.
           {R"({"mediaType": 7, "layers": {}})", "lists no layers"},
           {R"({"layers": [{"digest": 12, "size": 1}]})", "shardserve checks sha256"},
           {R"({"layers": [{"digest": "md5:x", "size": 1}]})", "shardserve checks sha256"},
           {absl::StrCat(R"({"layers": [)", layer, "}]}"), "not a file of a model artifact"},
           {R"({"layers": []})", "has no layers"}}) {
    auto r = ParseOciManifest(bad, "https://r.io/v2/o/m/blobs/", "", "oci://r.io/o/m");
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_THAT(Why(r.status()), HasSubstr(why)) << bad;
  }
}

TEST(OciTest, CredentialsFromTheDockerConfigEveryRegistryClientReads) {
  std::map<std::string, std::string> vars;
  auto env = [&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
  const std::string dir = ::testing::TempDir() + "/oci-docker-config";
  std::filesystem::create_directories(dir);
  { std::ofstream(dir + "/config.json") << R"({"auths": {"r.io": {"auth": "dTpw"}}})"; }
  vars["DOCKER_CONFIG"] = dir;
  vars["SHARDSERVE_OCI_PLAIN_HTTP"] = "mirror:5000, other:80";
  auto o = OciOptions::FromEnv(env);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_THAT(o->docker_config, HasSubstr("dTpw"));
  EXPECT_EQ(o->plain_http, (std::vector<std::string>{"mirror:5000", "other:80"}));
  vars.erase("DOCKER_CONFIG");
  vars["HOME"] = "/nonexistent";
  EXPECT_EQ(OciOptions::FromEnv(env)->docker_config, "");
}

TEST(HfTest, OptionsFromTheEnvironmentHuggingfaceHubReads) {
  std::map<std::string, std::string> vars;
  auto env = [&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
  EXPECT_EQ(HfOptions::FromEnv(env)->endpoint, "https://huggingface.co");
  vars = {{"HF_ENDPOINT", "http://mirror:8090/"}, {"HF_TOKEN", "hf_abc"}};
  EXPECT_EQ(HfOptions::FromEnv(env)->endpoint, "http://mirror:8090");
  EXPECT_EQ(HfOptions::FromEnv(env)->token, "hf_abc");
  vars["HF_TOKEN"] = "hf abc";
  EXPECT_THAT(Why(HfOptions::FromEnv(env).status()), HasSubstr("HF_TOKEN holds a character"));
  vars = {{"HF_ENDPOINT", "mirror"}};
  EXPECT_THAT(Why(HfOptions::FromEnv(env).status()), HasSubstr("must be an http://"));
}

}  // namespace
}  // namespace shardserve::source
