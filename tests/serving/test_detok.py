"""spade.serving.detok.IncrementalDetokenizer: the pieces it emits join to the whole
decode (multi-byte characters split across tokens, special tokens), at a bounded window
per token; and AsyncEngine's streamed text equals the decode of its token ids."""

from __future__ import annotations

import random

import pytest

from spade.serving.detok import REPLACEMENT, IncrementalDetokenizer

TEXTS = [
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Ünïcödé: 日本語のテキスト, emoji 🚀🎉 and math ∑ x² ≤ ∞ — dashes.",
    "  leading spaces,\ttabs\n\nand  double  spaces.  ",
]


@pytest.fixture(scope="module")
def tokenizer():
    try:
        from transformers import AutoTokenizer

        from spade.models.registry import resolve_model

        return AutoTokenizer.from_pretrained(str(resolve_model("smollm2-135m")))
    except Exception as e:  # the weights' package (and its tokenizer) is not installed here
        pytest.skip(f"the SmolLM2-135M tokenizer is not available: {e}")


class Counting:
    """A tokenizer wrapper that records how many ids each decode call got."""

    def __init__(self, tok):
        self.tok, self.sizes = tok, []

    def decode(self, ids, **kw):
        self.sizes.append(len(ids))
        return self.tok.decode(ids, **kw)


def stream(tok, ids: list[int], ref=None) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed ``ids`` one by one; after each, check against ``ref`` (default ``tok``)'s whole decode."""
    ref = ref or tok
    d = IncrementalDetokenizer(tok)
    pieces, grown = [], []
    for n in range(1, len(ids) + 1):
        grown.append(ids[n - 1])
        pieces.append(d.step(grown))
        whole = ref.decode(grown, skip_special_tokens=True)
        # what was emitted is the whole decode up to its held-back incomplete character
        assert whole.startswith(d.text), (n, d.text, whole)
        if not whole.endswith(REPLACEMENT):
            assert d.text == whole, (n, d.text, whole)
    pieces.append(d.flush(grown))
    return pieces, d


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_join_to_the_whole_decode(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces, d = stream(tokenizer, ids)
    assert "".join(pieces) == d.text == tokenizer.decode(ids, skip_special_tokens=True)


def test_random_ids_and_special_tokens(tokenizer):
    """Random ids (byte tokens that split characters, and never-completed ones that the
    whole decode ends with U+FFFD), with special tokens among them."""
    rng = random.Random(0)
    specials = list(tokenizer.all_special_ids)
    assert specials
    V = len(tokenizer)
    for trial in range(40):
        n = rng.randrange(1, 80)
        ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(V) for _ in range(n)]
        pieces, d = stream(tokenizer, ids)
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True), (trial, ids)


def test_split_multibyte_character_waits(tokenizer):
    """A character whose bytes span two tokens emits nothing until the second arrives."""
    ids = tokenizer("🚀", add_special_tokens=False)["input_ids"]
    assert len(ids) >= 2  # byte-level BPE: the emoji's 4 bytes are not one token
    d = IncrementalDetokenizer(tokenizer)
    assert [d.step(ids[:n]) for n in range(1, len(ids))] == [""] * (len(ids) - 1)
    assert d.step(ids) == "🚀"


def test_decode_work_per_token_is_bounded(tokenizer):
    """A 1,500-token output decodes windows of a few ids per token, not the whole text
    (the O(n^2) this replaces)."""
    ids = tokenizer(" ".join(TEXTS) * 30, add_special_tokens=False)["input_ids"][:1500]
    assert len(ids) == 1500
    counting = Counting(tokenizer)
    pieces, d = stream(counting, ids, ref=tokenizer)
    assert d.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert max(counting.sizes) <= 8, max(counting.sizes)
    assert sum(counting.sizes) <= 6 * len(ids)


def test_engine_streams_the_decode_of_its_ids(tokenizer):
    """AsyncEngine on SmolLM2: every streamed output's text is the decode of its ids
    (the incremental path), and the deltas join to the final text."""
    import asyncio

    import spade
    from spade.serving import SamplingParams

    try:
        cfg = spade.load_config(None, overrides=[
            "model.name=smollm2-135m", "model.backend=fast", "model.dtype=float32", "model.device=cpu",
            "model.max_seq_len=96", "model.chat_template=false", "runtime.topology=inline",
            "serving.max_batch=2", "policy.name=full", "generation.stop_at_eos=false"])
        eng = spade.AsyncEngine(cfg)
    except spade.SpadeError as e:
        pytest.skip(f"SmolLM2-135M is not available: {e}")

    async def main():
        outs = []
        async for o in eng.generate("Ünïcödé and emoji: 🚀", SamplingParams(max_tokens=40, ignore_eos=True,
                                                                               temperature=1.0, seed=3), "r"):
            outs.append(o)
        await eng.close()
        return outs

    outs = asyncio.run(main())
    last = outs[-1]
    assert last.finish_reason == "length" and len(last.token_ids) == 40
    assert last.text == tokenizer.decode(last.token_ids, skip_special_tokens=True)
    assert "".join(o.delta_text for o in outs) == last.text
    for o in outs[:-1]:
        whole = tokenizer.decode(o.token_ids, skip_special_tokens=True)
        assert whole.startswith(o.text)
