#include "devtools/corpus.h"

namespace shardserve {

// Plain English prose written for this project; gen-model trains its BPE tokenizer on it.
std::string_view DefaultCorpus() {
  return R"corpus(The model is too large for one machine, so we cut it into pieces and let many
processes work on it together. Each piece is called a shard. The shards of one stage sit on the
same node and talk to each other over fast links; the stages of one replica sit on different
nodes and pass their activations along the pipeline, one after the other.

When a request arrives, the leader turns the text into tokens, and the tokens flow through every
layer of the network. Each layer reads its weights, mixes the tokens with attention, and passes
the result to the next layer. At the end, the last stage turns the hidden state into a score for
every word in the vocabulary, and the sampler picks the next token. Then the whole process starts
again for the token after that, until the answer is complete or the limit is reached.

A good serving system tells the truth about itself. If a shard is slow, the dashboard should say
which one. If a node disappears, the operator should notice within seconds, create the missing
pods again, and count the restart. If a request is malformed, the server should answer with a
clear error that names the problem, and it should keep serving everyone else.

The weather was cold that morning, and the river ran fast and grey under the old stone bridge.
Children walked to school in long coats, their breath making small clouds in the air. A baker on
the corner opened his shop at six, and the smell of fresh bread drifted down the street. By noon
the sun had come out, the snow on the roofs began to melt, and water dripped from every gutter.

She read the letter twice before she put it down. It said that the garden would be sold in the
spring, that the house would be empty by summer, and that nobody in the family wanted to keep the
piano. She thought of the evenings when her grandmother played for them, slowly and carefully,
and of the way the notes seemed to stay in the room long after the music had stopped.

Numbers matter too: there are 7 days in a week, 12 months in a year, 24 hours in a day, and 60
minutes in an hour. A kilobyte is 1024 bytes, and a gigabyte is 1024 megabytes. The first prime
numbers are 2, 3, 5, 7, 11, 13, 17, 19, 23 and 29. In 1969 people walked on the moon for the
first time; in 2026 we still write programs that count, compare and move data from one place to
another, faster than before but with the same care.

To train a tokenizer, we count how often pairs of symbols appear next to each other, merge the
most frequent pair into a new symbol, and repeat. Common words become single tokens, rare words
are split into smaller parts, and any byte can still be written, so no text is ever lost. The
decoder does the same steps backwards and gives back exactly the text that went in.

Questions are welcome: what is the capital of France? How many legs does a spider have? Why is
the sky blue during the day and red in the evening? Where do the birds go in winter? Who wrote
the first computer program, and what did it compute? When will the next train leave the station?
)corpus";
}

}  // namespace shardserve
