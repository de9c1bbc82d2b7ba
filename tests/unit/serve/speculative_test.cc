// Prompt lookup (n-gram drafts): the tokens after the latest earlier occurrence of the sequence's
// longest recurring suffix (4 down to 2 tokens), over its prompt and output as one sequence.
#include "serve/speculative.h"

#include <gtest/gtest.h>

namespace shardserve {
namespace {

using Ids = std::vector<int32_t>;

TEST(NgramDraftsTest, TheLatestOccurrenceOfTheLongestSuffixDrafts) {
  SpeculativeConfig c;
  c.method = SpeculativeMethod::kNgram;
  // "5 6" recurs at 1 and at 6: the latest (6) drafts what followed it.
  const Ids prompt = {1, 5, 6, 7, 8, 9, 5, 6, 10, 11, 12};
  EXPECT_EQ(NgramDrafts(prompt, Ids{5, 6}, c, 3), (Ids{10, 11, 12}));
  EXPECT_EQ(NgramDrafts(prompt, Ids{5, 6}, c, 1), (Ids{10}));
  // The longer suffix "9 5 6" wins over the later "5 6".
  EXPECT_EQ(NgramDrafts(prompt, Ids{9, 5, 6}, c, 2), (Ids{10, 11}));
  // Across the prompt and the output; drafts stop at the sequence's end.
  EXPECT_EQ(NgramDrafts(Ids{3, 4}, Ids{7, 3, 4}, c, 4), (Ids{7, 3, 4}));
  // A one-token suffix is below ngram_min (2): nothing; with ngram_min 1 it drafts.
  EXPECT_TRUE(NgramDrafts(Ids{1, 2, 3, 1}, Ids{}, c, 4).empty());
  c.ngram_min = 1;
  EXPECT_EQ(NgramDrafts(Ids{1, 2, 3, 1}, Ids{}, c, 4), (Ids{2, 3, 1}));
  // Nothing recurs, no room, too short.
  EXPECT_TRUE(NgramDrafts(Ids{1, 2, 3, 4}, Ids{}, c, 4).empty());
  EXPECT_TRUE(NgramDrafts(prompt, Ids{5, 6}, c, 0).empty());
  EXPECT_TRUE(NgramDrafts(Ids{1}, Ids{}, c, 4).empty());
}

// Multi-token prediction: the draft a step's result carried is handed back for the sequence's
// next step only while the sequence has the length it was made for, one token at most.
TEST(MtpDrafterTest, ADraftIsForTheLengthItWasMadeFor) {
  MtpDrafter d;
  const Ids prompt{1, 2, 3}, output{4};
  d.Drafted(7, 4, 99);  // sequence 7, once it has 4 tokens
  d.Drafted(8, 9, 55);  // sequence 8 is shorter: a draft of a step it did not keep
  const auto got = d.Propose({{7, prompt, output, 3}, {8, prompt, output, 1}, {9, prompt, {}, 1}});
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[0], Ids{99});
  EXPECT_TRUE(got[1].empty());
  EXPECT_TRUE(got[2].empty());                                  // none made for it
  EXPECT_TRUE(d.Propose({{7, prompt, output, 0}})[0].empty());  // k = 0: none wanted
  d.Forget(7);                                                  // preempted or ended
  EXPECT_TRUE(d.Propose({{7, prompt, output, 1}})[0].empty());
}

}  // namespace
}  // namespace shardserve
