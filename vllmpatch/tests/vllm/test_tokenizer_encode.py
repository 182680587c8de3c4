"""The engine tokenizes prompts through the tokenizers library's encode_batch, which
lets go of the GIL while it works (encode holds it: the step loop would wait), only
where that gives the ids the Hugging Face tokenizer gives."""
from __future__ import annotations

import random


def _qwen(tmp_path):
    from frmps_engine import modeldir
    from frmps_engine.vllm.engine import VllmAdapter, VllmEngineConfig

    d = modeldir.write("qwen2.5-0.5b", str(tmp_path / "q05"))
    return VllmAdapter(VllmEngineConfig(model=d, num_blocks=64, max_model_len=512)).tokenizer()


def test_prompts_are_encoded_by_the_backend_batch_path_with_the_tokenizers_ids(tmp_path):
    tok = _qwen(tmp_path)
    assert tok._encoder is not None
    hf = tok._tok
    rng = random.Random(7)
    alphabet = "abc xyz\n\t  .,;:!?0123456789éü日本🙂<|>_/'\""
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 200))) for _ in range(300)]
    texts += ["<|im_start|>system\nYou are<|im_end|>", "<|endoftext|>" * 3, ""]
    for text in texts:
        assert tok.encode(text) == list(hf.encode(text, add_special_tokens=False)), text


def test_a_backend_that_encodes_otherwise_is_not_used(tmp_path):
    from frmps_engine.vllm.tokenizer import VllmTokenizer

    hf = _qwen(tmp_path)._tok

    class Backend:  # test double: the real backend, but its batch encode drops a leading space
        def __init__(self, real):
            self._real = real

        def encode_batch(self, texts, add_special_tokens=True):
            return self._real.encode_batch([t.lstrip(" ") for t in texts], add_special_tokens=add_special_tokens)

        def __getattr__(self, name):
            return getattr(self._real, name)

    class Tok:  # test double: the Hugging Face tokenizer with that backend
        backend_tokenizer = Backend(hf.backend_tokenizer)
        clean_up_tokenization_spaces = False
        eos_token_id = hf.eos_token_id

        def encode(self, text, add_special_tokens=True):
            return hf.encode(text, add_special_tokens=add_special_tokens)

        def decode(self, ids, skip_special_tokens=False):
            return hf.decode(ids, skip_special_tokens=skip_special_tokens)

    t = VllmTokenizer(Tok())
    assert t._encoder is None
    assert t.encode(" leading") == list(hf.encode(" leading", add_special_tokens=False))
