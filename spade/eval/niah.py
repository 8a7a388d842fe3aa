"""Measurement 4: needle in a haystack over the essays.

A needle sentence ``The secret passphrase is <word>-<number>.`` is inserted at a
relative depth of about ``n`` tokens of essays (at a sentence boundary), and
the model is asked for the passphrase after the essays. The prompt pass is
dense (as in every policy), so the question has seen the needle; the answer is
written by sparse decode steps, which must find the needle among the cached
tokens again to copy it. Scored: exact retrieval (the passphrase appears in the
answer, ignoring case) per policy, budget, context length and depth, and the same cell under
full attention for reference.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from spade.eval.common import check_policy_entries, load_model, policy_config, policy_label, progress, say, write_json
from spade.eval.config import NiahEvalConfig

_WORDS = ("amber", "falcon", "cobalt", "orchid", "granite", "saffron", "harbor", "juniper", "lantern", "meadow",
          "quartz", "raven", "tundra", "velvet", "willow", "zephyr")
QUESTION = "What is the secret passphrase mentioned in the text above? Answer with the passphrase only."


def passphrase(rng: random.Random) -> str:
    return f"{rng.choice(_WORDS)}-{rng.randint(1000, 9999)}"


def haystack_prompt(tokenizer, n_tokens: int, depth: float, secret: str) -> str:
    """About ``n_tokens`` tokens of essays with the needle at ``depth`` (0: start,
    1: end), moved to the next sentence end so no sentence is cut."""
    from spade.data import essay_context

    hay = essay_context(tokenizer, n_tokens)
    cut = int(len(hay) * depth)
    if 0 < cut < len(hay):
        nxt = hay.find(". ", cut)
        cut = nxt + 2 if 0 <= nxt < len(hay) - 2 else cut
    needle = f" The secret passphrase is {secret}. "
    return f"{hay[:cut]}{needle}{hay[cut:]}\n\n{QUESTION}"


def run_niah(cfg: NiahEvalConfig, out_dir: Path, device: str = "cpu") -> dict:
    """Exact passphrase retrieval for every policy/budget/length/depth; writes ``niah_<model>.json``."""
    from spade.policies.full import FullPolicyConfig
    from spade.eval import plots
    from spade.eval.decoding import chat_prompt, decode, encode_batch, prefill
    from spade.models.hf import HFBackend
    from spade.policies import build_policy

    check_policy_entries(cfg.policies, "niah", sink_tokens=cfg.sink_tokens, recent_tokens=cfg.recent_tokens,
                         budgets=cfg.budgets)
    model, tok = load_model(cfg.model, device)
    backend = HFBackend(model, tok)
    rng = random.Random(cfg.seed)
    cells = [(n, d, passphrase(rng)) for n in cfg.context_lengths for d in cfg.depths]
    runs: list[tuple[str, str, int | None, Any]] = [("full", "full", None, FullPolicyConfig())]
    for b in cfg.budgets:
        for e in cfg.policies:
            runs.append((f"{policy_label(e)} K={b}", policy_label(e), b,
                         policy_config(e, b, sink_tokens=cfg.sink_tokens, recent_tokens=cfg.recent_tokens)))
    # batches of cells of the same context length (similar prompt lengths: little padding)
    batches = []
    for n in cfg.context_lengths:
        same = [c for c in cells if c[0] == n]
        batches += [same[i:i + cfg.batch_size] for i in range(0, len(same), cfg.batch_size)]
    records: list[dict[str, Any]] = []
    with progress(f"niah {cfg.model}", len(batches) * len(runs)) as advance:
        for batch in batches:
            texts = [chat_prompt(tok, haystack_prompt(tok, n, d, s)) for n, d, s in batch]
            ids, mask = encode_batch(tok, texts)
            advance(0, description=f"niah {cfg.model} prefill {ids.shape[1]} tokens")
            pre = prefill(backend, ids, mask)
            for lab, pol, b, pc in runs:
                advance(0, description=f"niah {cfg.model} {lab}")
                rows, _ = decode(backend, pre, build_policy(pc, backend.spec), cfg.max_new_tokens,
                                 backend.eos_token_ids)
                for (n, d, s), g, m in zip(batch, rows, mask):
                    ans = tok.decode(g, skip_special_tokens=True)
                    records.append({"run": lab, "policy": pol, "K": b, "context": n, "depth": d,
                                    "prompt_tokens": int(m.sum()), "secret": s, "answer": ans.strip(),
                                    "found": s.lower() in ans.lower()})
                advance()
            backend.close()
    summary = []
    for lab, pol, b, _ in runs:
        mine = [r for r in records if r["run"] == lab]
        summary.append({"run": lab, "policy": pol, "K": b, "retrieval": sum(r["found"] for r in mine) / len(mine),
                        "n": len(mine),
                        "by_context": {str(n): sum(r["found"] for r in mine if r["context"] == n)
                                       / max(1, sum(1 for r in mine if r["context"] == n))
                                       for n in cfg.context_lengths}})
    res = {"model": cfg.model, "rows": summary, "records": records}
    write_json(out_dir / f"niah_{cfg.model}.json", res | {"config": cfg.model_dump(mode="json")})
    res["plots"] = plots.niah_plot(res, cfg, out_dir)
    say(f"niah {cfg.model}: wrote {out_dir / f'niah_{cfg.model}.json'}")
    return res
