"""Runs llama.cpp's convert_hf_to_gguf.py on a benchmark checkpoint (benches/llama_cpp.sh).

The random checkpoints of benches/make_big_decoder.py carry the tiny test tokenizer
(tests/fixtures/tiny-olmoe/tokenizer.json: a 320-token byte-level BPE). The converter identifies
a BPE pre-tokenizer by hashing the ids of a fixed text and refuses any hash it does not know
(`NotImplementedError: BPE pre-tokenizer was not recognized`). This wrapper is the only change
to the converter: when that check refuses, `get_vocab_base_pre` answers "gpt-2" (GPT-2's
byte-level regex, which is what that tokenizer uses) and says so on stderr. Tensors are converted
by the unmodified converter; the tokenizer only matters to llama.cpp for text, and llama-bench
feeds token ids.

Usage: python benches/llama_cpp_convert.py LLAMA_CPP_DIR [convert_hf_to_gguf.py arguments...]
"""

import sys
from pathlib import Path


def main():
    llama_dir = Path(sys.argv[1]).resolve()
    sys.path.insert(0, str(llama_dir / "gguf-py"))
    sys.path.insert(0, str(llama_dir))
    import convert_hf_to_gguf  # noqa: E402  (the converter's own module, unmodified)
    from conversion.base import TextModel  # noqa: E402

    known = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer):
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            print("llama_cpp_convert.py: unknown BPE pre-tokenizer hash (random test tokenizer); "
                  "writing tokenizer.ggml.pre = 'gpt-2'", file=sys.stderr)
            return "gpt-2"

    TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [str(llama_dir / "convert_hf_to_gguf.py")] + sys.argv[2:]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
