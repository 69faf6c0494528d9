"""A model's config with no download: a bundled name, a config.json (or its folder), or a Hub id
(lesson 1, "how many parameters, exactly").

The bundled configs under `course_lib/configs/` are the published `config.json` values of well-known
models (facts, no weights). A config read from a file is kept on disk (`SavedConfig`), so that a
second `course-lib plan` of the model reads its fields without importing transformers.
"""

from __future__ import annotations

import copy
import difflib
import json
import re
import socket
import warnings
from pathlib import Path
from urllib.parse import urlparse

from course_lib.cache import cached_answer
from course_lib.errors import UserError

CONFIG_DIR = Path(__file__).with_name("configs")

# Where each bundled config comes from (the Hub repository whose config.json it copies).
HUB_IDS = {
    "gpt2": "openai-community/gpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B",
    "llama-3.2-3b": "meta-llama/Llama-3.2-3B",
    "llama-2-7b": "meta-llama/Llama-2-7b-hf",
    "llama-2-13b": "meta-llama/Llama-2-13b-hf",
    "llama-2-70b": "meta-llama/Llama-2-70b-hf",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
    "mistral-7b": "mistralai/Mistral-7B-v0.1",
    "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B",
    "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B",
    "phi-3-mini": "microsoft/Phi-3-mini-4k-instruct",
    "gemma-2-2b": "google/gemma-2-2b",
    "mixtral-8x7b": "mistralai/Mixtral-8x7B-v0.1",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
}


class ModelNotFound(UserError):
    """An unknown model name or a config that cannot be read; the message says what to do."""


def bundled_models() -> list[str]:
    """Names of the bundled configs, e.g. 'llama-2-7b' (lesson 1)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def hub_id_as_pasted(text: str) -> str:
    """A Hub id as people paste it, understood: 'https://huggingface.co/org/name', 'org/name/' and
    'org/name/tree/main' are 'org/name' (a local path that exists is kept as it is)."""
    text = text.strip()
    if Path(text).expanduser().exists():
        return text
    cleaned = re.sub(r"^(https?://)?(www\.)?(huggingface\.co|hf\.co)/", "", text).rstrip("/")
    return re.sub(r"/(tree|blob|resolve)/[^/]+(/.*)?$", "", cleaned) or text


def _normalise(name: str) -> str:
    """A cleaned name (`hub_id_as_pasted`) as the bundled name it may stand for."""
    name = name.lower()
    for hub_name, hub_id in HUB_IDS.items():  # accept the Hub id too: "meta-llama/Llama-2-7b-hf"
        if name == hub_id.lower():
            return hub_name
    return name


def load_config(name_or_path: str | Path):
    """A transformers config from a bundled name ('llama-2-7b'), a Hub id of a bundled model, a
    config.json file, or a folder holding one (lesson 1).

    Unknown names raise ModelNotFound listing the closest bundled names; unreadable files raise
    ModelNotFound saying what is wrong with them.
    """
    from transformers import AutoConfig  # off the import path: transformers takes seconds to import

    text = hub_id_as_pasted(str(name_or_path))
    path = _config_file(text)
    if path is None:
        return _hub_config(text)
    data = _read_json(path)
    model_type = data.get("model_type")
    if not isinstance(model_type, str):
        raise ModelNotFound(f'{path}: config has no "model_type" string, so the architecture is unknown')
    fields = {k: v for k, v in data.items() if k != "model_type"}
    _check_sizes_given(text if path.parent == CONFIG_DIR else str(path), model_type, fields)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoConfig.for_model(model_type, **fields)
    except Exception as error:  # ValueError, or huggingface_hub's StrictDataclassError naming the field
        raise ModelNotFound(f"cannot build a {model_type!r} config: {' '.join(str(error).split())[:300]}") from None


def _config_file(text: str) -> Path | None:
    """The config.json a bundled name or a path names (`text` cleaned by `hub_id_as_pasted`), None for a
    Hub id (transformers fetches it); ModelNotFound for an unknown name or a path with no config file."""
    key = _normalise(text)
    path = Path(text).expanduser()
    if key in bundled_models():
        return CONFIG_DIR / f"{key}.json"
    if not path.exists() and re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", text) and not text.endswith(".json"):
        return None
    if path.exists() or text.endswith(".json") or "/" in text or "\\" in text:
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ModelNotFound(f"no config file at {path}")
        return path
    close = difflib.get_close_matches(key, bundled_models(), n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise ModelNotFound(
        f"unknown model {text!r}: {hint}use a bundled name "
        f"({', '.join(bundled_models())}), a config.json path, or --params N"
    )


SIZE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def _check_sizes_given(source: str, model_type: str, fields: dict) -> None:
    """A config must give the model's own sizes: transformers would fill in the defaults of its
    class (for "llama", Llama-2-7B's), and the plan would be another model's (lesson 1)."""
    from transformers import CONFIG_MAPPING  # off the import path: transformers takes seconds to import

    if model_type not in CONFIG_MAPPING:  # transformers' own message lists all its 400 model types
        close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING.keys()), n=3, cutoff=0.6)
        raise ModelNotFound(
            f'{source}: unknown "model_type" {model_type!r}: '
            + (
                f"did you mean {' or '.join(close)}?"
                if close
                else "give the model_type of a transformers architecture (e.g. llama, gpt2, mistral, qwen2)"
            )
        )
    config_class = CONFIG_MAPPING[model_type]
    aliases = getattr(config_class, "attribute_map", {}) or {}
    defaults = config_class()
    missing = [
        name
        for name in SIZE_FIELDS
        if hasattr(defaults, name) and name not in fields and aliases.get(name) not in fields
    ]
    if missing:
        raise ModelNotFound(
            f"{source}: the config has no {', '.join(missing)}; transformers would use "
            f"{config_class.__name__}'s defaults (another model's sizes): "
            "give this model's own values"
        )
    _check_size_values(
        source,
        {
            name: fields.get(name, fields.get(aliases.get(name)))
            for name in SIZE_FIELDS + ("num_key_value_heads", "intermediate_size", "max_position_embeddings")
        },
        "head_dim" in fields,
    )


def _check_size_values(source: str, sizes: dict, head_dim_given: bool) -> None:
    """Each size a positive whole number, the heads dividing the width and the key/value heads dividing
    the heads: ModelNotFound naming the field and the fix, not transformers' or torch's error (lesson 1)."""
    for name, value in sizes.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ModelNotFound(f'{source}: "{name}" must be a positive whole number, got {value!r}')
    hidden, heads, kv_heads = sizes["hidden_size"], sizes["num_attention_heads"], sizes["num_key_value_heads"]
    if hidden is not None and heads is not None and hidden % heads and not head_dim_given:
        raise ModelNotFound(
            f'{source}: "hidden_size" {hidden} is not a multiple of "num_attention_heads" '
            f"{heads}: give a number of heads that divides it (e.g. {_divisor_near(hidden, heads)})"
        )
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise ModelNotFound(
            f'{source}: "num_attention_heads" {heads} is not a multiple of "num_key_value_heads" '
            f"{kv_heads}: give key/value heads that divide it (e.g. {_divisor_near(heads, kv_heads)})"
        )


def _divisor_near(whole: int, wanted: int) -> int:
    return min((d for d in range(1, whole + 1) if whole % d == 0), key=lambda d: (abs(d - wanted), d))


def _hub_config(hub_id: str):
    """A config from the Hugging Face Hub (AutoConfig.from_pretrained: config.json only, no weights),
    or ModelNotFound saying how to pass a saved config.json when the Hub cannot be reached."""
    from huggingface_hub import constants  # off the import path: huggingface_hub is slow to import
    from transformers import AutoConfig  # off the import path: transformers takes seconds to import

    offline = constants.is_offline_mode() or not _hub_reachable(constants.ENDPOINT)
    try:  # offline: the local Hugging Face cache only (no retries)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoConfig.from_pretrained(hub_id, local_files_only=offline)
    except Exception as error:  # offline and not cached, gated, no such repository, remote code
        save = f"save its config.json (https://huggingface.co/{hub_id}/blob/main/config.json) and give its path"
        if offline:
            raise ModelNotFound(
                f"{hub_id!r} is no local path and the Hugging Face Hub cannot be reached "
                f"(nor is it in the local cache): {save}"
            ) from None
        reason = " ".join(str(error).split())[:200]
        raise ModelNotFound(
            f"cannot load {hub_id!r} from the Hugging Face Hub ({type(error).__name__}: {reason}); or {save}"
        ) from None


def _hub_reachable(endpoint: str, timeout: float = 3.0) -> bool:
    """Whether the Hub's host answers a TCP connection within `timeout` seconds."""

    url = urlparse(endpoint)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
        return True
    except OSError:
        return False


def _check_causal_lm(config, source: str) -> None:
    """The planner traces decoder-only causal LMs; other architectures get one line (lesson 1)."""
    # off the import path: transformers takes seconds to import
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    model_type = getattr(config, "model_type", "")
    if getattr(config, "is_encoder_decoder", False):
        kind = "an encoder-decoder model"
    elif model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        kind = "an encoder (masked language model)"
    elif model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        kind = "not a causal language model"
    else:
        return
    raise ModelNotFound(
        f"{source}: {model_type!r} is {kind}; the planner covers decoder-only causal language "
        "models (GPT-2, Llama, Mistral, Qwen2, Phi-3, Gemma-2, ...): plan it with --params N"
    )


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ModelNotFound(
            f"{path} is not valid JSON (line {error.lineno}, column {error.colno}: {error.msg})"
        ) from None
    except (OSError, UnicodeDecodeError) as error:
        raise ModelNotFound(f"cannot read {path}: {error}") from None
    if not isinstance(data, dict):
        raise ModelNotFound(f"{path} must hold a JSON object (a config.json), not {type(data).__name__}")
    return data


class SavedConfig:
    """A transformers config as an earlier run read it: its class name, its JSON, and the fields the
    config answers with plain JSON values, kept on disk so that a second `course-lib plan` of a model
    never imports transformers, which alone takes longer than the rest of the run (lesson 1, "the
    planner"). Those fields read as on the config; anything else, and any change, needs the config
    itself: `transformers_config()` builds it from the kept JSON (not from the file, which may have
    changed since)."""

    def __init__(self, record: dict, config=None):
        object.__setattr__(self, "_record", record)
        object.__setattr__(self, "_config", config)

    @staticmethod
    def record_of(config) -> dict:
        """What is kept of a transformers config (plain JSON)."""
        fields = {}
        for name in config.to_dict():
            value = getattr(config, name, None)
            try:
                plain = not name.startswith("_") and json.loads(json.dumps(value)) == value
            except TypeError:  # a dtype or a nested config
                plain = False
            if plain:  # not a tuple either
                fields[name] = value
        return {
            "class": type(config).__name__,
            "json": config.to_json_string(use_diff=False),
            "fields": fields,
            "aliases": dict(getattr(type(config), "attribute_map", {}) or {}),
        }

    @property
    def class_name(self) -> str:
        return self._record["class"]

    def __repr__(self) -> str:
        return f"SavedConfig of a {self.class_name} {self._record['json']}"

    def __getattr__(self, name: str):
        if name.startswith("__") or "_record" not in self.__dict__:  # copy and pickle look for hooks,
            raise AttributeError(name)  # before the instance is filled
        key = self._record["aliases"].get(name, name)
        if key in self._record["fields"]:
            return copy.deepcopy(self._record["fields"][key])
        return getattr(transformers_config(self), name)

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"a SavedConfig is read-only: change a copy of transformers_config(config), not {name!r}")

    def to_json_string(self, use_diff: bool = True) -> str:
        return transformers_config(self).to_json_string(use_diff) if use_diff else self._record["json"]


def transformers_config(config):
    """The transformers config itself of a config or a SavedConfig (built once from its kept JSON)."""
    if not isinstance(config, SavedConfig):
        return config
    if config._config is None:
        from transformers import CONFIG_MAPPING  # off the import path: transformers takes seconds to import

        data = json.loads(config._record["json"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            object.__setattr__(config, "_config", CONFIG_MAPPING[data["model_type"]].from_dict(data))
    return config._config


def config_class_name(config) -> str:
    """The transformers class of a config or a SavedConfig, e.g. 'LlamaConfig'."""
    return config.class_name if isinstance(config, SavedConfig) else type(config).__name__


def config_key(name_or_path: str | Path) -> str:
    """What names a config: a bundled name (a Hub id of a bundled model too), a local path resolved,
    or the text itself (a Hub id), cleaned once here for `config_stamp` and `read_config`."""
    text = hub_id_as_pasted(str(name_or_path))
    key = _normalise(text)
    if key in bundled_models():
        return key
    path = Path(text).expanduser()
    return str(path.resolve()) if path.exists() else text


def config_stamp(key: str) -> tuple | None:
    """The (modification time, size) of the file a key names, None for a Hub id or a bad key: an
    edited config.json is read again."""
    try:
        path = _config_file(key)
        status = path.stat() if path is not None else None
    except (ModelNotFound, OSError):  # read_config says what is wrong
        return None
    return None if status is None else (status.st_mtime_ns, status.st_size)


def read_config(key: str):
    """The config a key names, checked to be a decoder-only causal LM: a SavedConfig for a bundled
    name or a file (kept on disk with the file's contents: a changed file is read again), the
    transformers config for a Hub id (transformers keeps it in its own cache)."""
    path = _config_file(key)
    if path is None:
        return _checked_config(key)
    loaded = {}

    def record() -> dict:
        loaded["config"] = _checked_config(key)
        return SavedConfig.record_of(loaded["config"])

    return SavedConfig(
        cached_answer("config", f"{key}\n{json.dumps(_read_json(path), sort_keys=True)}", record), loaded.get("config")
    )


def _checked_config(key: str):
    config = load_config(key)
    _check_causal_lm(config, key)
    return config
