"""Measurement 3: GSM8K answers under greedy sparse decoding vs full attention.

Each problem is asked through the model's chat template with an instruction to
reason briefly and end with ``#### <number>``; generation is greedy. For every
policy and budget: accuracy (the number after the last ``####``, else the last
number in the text, compared with the reference answer), the paired difference
with full attention (problems whose correctness changed), and token agreement
with the full-attention generation: the fraction of its tokens reproduced before
the first divergence, and the fraction of equal positions overall.

Budgets are small next to the generated reasoning (hundreds of tokens), so the
policy decides what most decode steps attend.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from spade.eval.common import check_policy_entries, load_model, policy_config, policy_label, progress, say, write_json
from spade.eval.config import Gsm8kEvalConfig

_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def load_gsm8k(n: int, first: int = 0) -> list[dict[str, Any]]:
    """``n`` test problems from ``first`` on (file order): {question, answer (str), idx}."""
    from spade.data import gsm8k_path

    out = []
    with open(gsm8k_path("test"), encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i < first:
                continue
            if len(out) >= n:
                break
            d = json.loads(line)
            out.append({"question": d["question"], "answer": gold_answer(d["answer"]), "idx": d.get("idx", i)})
    return out


def _norm_number(s: str) -> str | None:
    s = s.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        v = float(s)
    except ValueError:
        return None
    return str(int(v)) if v == int(v) else f"{v:g}"


def gold_answer(solution: str) -> str:
    """The reference number after ``####`` of a GSM8K solution."""
    tail = solution.rsplit("####", 1)[-1]
    m = _NUM.search(tail)
    if m is None:
        raise ValueError(f"no number after '####' in {solution[-80:]!r}")
    return _norm_number(m.group(0)) or m.group(0)


def parse_answer(text: str) -> str | None:
    """The model's answer: the first number after the last ``####``; else the
    number in the last ``\\boxed{...}``; else the last number of the text."""
    if "####" in text:
        m = _NUM.search(text.rsplit("####", 1)[-1])
        if m:
            return _norm_number(m.group(0))
    boxed = re.findall(r"\\boxed\{([^}]*)\}", text)
    if boxed:
        m = _NUM.search(boxed[-1])
        if m:
            return _norm_number(m.group(0))
    nums = _NUM.findall(text)
    return _norm_number(nums[-1]) if nums else None


def run_gsm8k(cfg: Gsm8kEvalConfig, out_dir: Path, device: str = "cpu") -> dict:
    """Greedy GSM8K under full attention and every policy/budget; writes ``gsm8k_<model>.json``."""
    from spade.policies.full import FullPolicyConfig
    from spade.eval import plots
    from spade.eval.decoding import agreement, chat_prompt, decode, encode_batch, prefill
    from spade.models.hf import HFBackend
    from spade.policies import build_policy

    check_policy_entries(cfg.policies, "gsm8k", sink_tokens=cfg.sink_tokens, recent_tokens=cfg.recent_tokens,
                         budgets=cfg.budgets)
    model, tok = load_model(cfg.model, device)
    backend = HFBackend(model, tok)
    problems = load_gsm8k(cfg.n_problems, cfg.first_problem)
    runs: list[tuple[str, Any]] = [("full", FullPolicyConfig())]
    for b in cfg.budgets:
        for e in cfg.policies:
            runs.append((f"{policy_label(e)} K={b}",
                         policy_config(e, b, sink_tokens=cfg.sink_tokens, recent_tokens=cfg.recent_tokens)))
    gens: dict[str, list[list[int]]] = {lab: [] for lab, _ in runs}
    attended: dict[str, list[float]] = {lab: [] for lab, _ in runs}
    prompt_lens: list[int] = []
    batches = [problems[i:i + cfg.batch_size] for i in range(0, len(problems), cfg.batch_size)]
    with progress(f"gsm8k {cfg.model}", len(batches) * len(runs)) as advance:
        for batch in batches:
            texts = [chat_prompt(tok, f"{p['question']}\n\n{cfg.instruction}") for p in batch]
            ids, mask = encode_batch(tok, texts)
            prompt_lens += mask.sum(-1).tolist()
            advance(0, description=f"gsm8k {cfg.model} prefill")
            pre = prefill(backend, ids, mask)
            for lab, pc in runs:
                advance(0, description=f"gsm8k {cfg.model} {lab}")
                rows, att = decode(backend, pre, build_policy(pc, backend.spec), cfg.max_new_tokens,
                                   backend.eos_token_ids)
                gens[lab] += rows
                attended[lab].append(att)
                advance()
            backend.close()
    n = len(problems)
    full_ok = None
    rows_out = []
    for lab, _ in runs:
        texts = [tok.decode(g, skip_special_tokens=True) for g in gens[lab]]
        answers = [parse_answer(t) for t in texts]
        ok = [a is not None and a == p["answer"] for a, p in zip(answers, problems)]
        if full_ok is None:
            full_ok = ok
        acc = sum(ok) / n
        pref, over = zip(*[agreement(r, g) for r, g in zip(gens["full"], gens[lab])])
        rows_out.append({
            "run": lab, "accuracy": acc, "stderr": math.sqrt(max(acc * (1 - acc), 1e-12) / n),
            "correct": sum(ok), "n": n,
            "changed_vs_full": sum(a != b for a, b in zip(ok, full_ok)),
            "gained_vs_full": sum(a and not b for a, b in zip(ok, full_ok)),
            "lost_vs_full": sum(b and not a for a, b in zip(ok, full_ok)),
            "prefix_agreement": sum(pref) / n, "token_agreement": sum(over) / n,
            "mean_generated": sum(len(g) for g in gens[lab]) / n,
            "mean_attended": sum(attended[lab]) / len(attended[lab]),
            "samples": [{"idx": p["idx"], "gold": p["answer"], "answer": a, "correct": o, "text": t}
                        for p, a, o, t in zip(problems, answers, ok, texts)],
        })
    res = {"model": cfg.model, "n_problems": n, "mean_prompt_tokens": sum(prompt_lens) / max(1, len(prompt_lens)),
           "rows": rows_out}
    write_json(out_dir / f"gsm8k_{cfg.model}.json", res | {"config": cfg.model_dump(mode="json")})
    res["plots"] = plots.gsm8k_plot(res, out_dir)
    say(f"gsm8k {cfg.model}: wrote {out_dir / f'gsm8k_{cfg.model}.json'}")
    return res
