"""Models named by where they live, not by a local folder: `kvfleet serve Qwen/Qwen2.5-0.5B-Instruct`
(a Hub id, as vLLM takes it), `hf://ORG/NAME[@REVISION]`, `s3://BUCKET/PREFIX`. The model is pulled
with `kvfleet pull` (kvfleet_runtime.pull: resumable, verified, atomic) into a cache folder
under $KVFLEET_CACHE_DIR (default $XDG_CACHE_HOME/kvfleet, else ~/.cache/kvfleet), then loaded
from there; a later start pulls only what changed (nothing, if the revision has not moved).
With HF_HUB_OFFLINE set, a Hub model already in the cache is loaded without asking the Hub.

The engine entry points (LLMEngine, AsyncLLMEngine, the server's command line) resolve the
reference once, before any other process or rank starts, so each loads the local folder. LoRA
adapters named the same way are pulled where they are first named: the server's --lora-modules
at start, AsyncLLMEngine.add_lora / generate (in a worker thread) and LLM.generate.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

# ORG/NAME[@REVISION] as the Hub spells repo ids (a bare NAME is a local path's job)
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9._/-]+)?$")


def cache_dir() -> Path:
    explicit = os.environ.get("KVFLEET_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvfleet"


def remote_source(model: str) -> str | None:
    """The pull source `model` names (hf://... or s3://...), or None for a local path (a path
    that exists wins over a Hub id of the same spelling)."""
    if model.startswith(("hf://", "s3://")):
        return model
    if _HUB_ID.match(model) and not Path(model).exists():
        return f"hf://{model}"
    return None


def served_name(model: str) -> str:
    """The name a remote model is served under by default: a Hub id as given (vLLM's), an S3
    prefix's last segment (the operator's)."""
    if model.startswith("s3://"):
        return model.rstrip("/").rpartition("/")[2]
    return model.removeprefix("hf://").partition("@")[0]


def local_folder(source: str) -> Path:
    """Where the cache keeps `source`: hf/ORG/NAME/REVISION (one folder a revision as named),
    s3/BUCKET/PREFIX."""
    scheme, _, rest = source.partition("://")
    if scheme == "hf":
        repo, _, revision = rest.partition("@")
        parts = [*repo.split("/"), (revision or "main").replace("/", "--")]
    else:
        parts = [p for p in rest.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise ValueError(f"model {source!r}: '.' and '..' are not path segments of a model")
    return cache_dir().joinpath(scheme, *parts)


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve(model: str) -> tuple[str, str | None]:
    """(a local path to load, the name to serve it under by default, or None for a local path).
    Pulls a remote model into the cache first; a failed pull is a ValueError saying why."""
    source = remote_source(model)
    if source is None:
        return model, None
    from kvfleet_runtime import pull

    dest = local_folder(source)
    # a bare ORG/NAME may also be a local path mistyped: say that it is none
    what = f"model {model!r}" + ("" if source == model else " (no such local folder; read as a Hub id)")
    if source.startswith("hf://") and _offline():
        marker = pull.read_marker(dest)
        if marker is None or marker.get("source") != f"hf://{source[5:].partition('@')[0]}":
            raise ValueError(f"{what} is not in the cache ({dest}) and HF_HUB_OFFLINE is set: "
                             "unset it to pull the model from the Hub, or give a local folder")
        logger.info("%s: HF_HUB_OFFLINE is set; loading the cached pull of commit %s from %s",
                    model, marker.get("commit"), dest)
        return str(dest), served_name(model)
    print(f"kvfleet: pulling {source} into {dest}", file=sys.stderr, flush=True)
    try:
        result = pull.pull(source, dest, pull.PullOptions(progress=False))
    except pull.PullError as e:
        raise ValueError(f"cannot pull {what}: {e}") from e
    what = "up to date" if result.up_to_date else f"{result.bytes_fetched / 2**20:.1f} MiB fetched"
    print(f"kvfleet: {source}{'' if result.commit is None else ' at ' + result.commit[:12]}: {what}, "
          f"{result.files} files in {dest}", file=sys.stderr, flush=True)
    return str(dest), served_name(model)


def with_revision(model: str, revision: str | None) -> str:
    """`model` at the Hub revision `revision` (vLLM's --revision): hf://ORG/NAME@REVISION for a
    Hub id or hf:// model named without one. ValueError for a model that is not on the Hub, or
    that names another revision itself."""
    if revision is None:
        return model
    source = remote_source(model)
    if source is None or not source.startswith("hf://"):
        where = "an S3 prefix" if source else "a local path"
        raise ValueError(f"revision {revision!r} is a Hub revision; model {model!r} is {where} "
                         "(revisions are for a Hub id ORG/NAME or hf://ORG/NAME)")
    repo, _, named = source.removeprefix("hf://").partition("@")
    if named and named != revision:
        raise ValueError(f"model {model!r} names revision {named!r} and revision is "
                         f"{revision!r}; give one")
    return f"hf://{repo}@{revision}"


def _tokenizer_revision(config, source: str) -> None:
    """vLLM's tokenizer_revision: transformers fetches a tokenizer named by a Hub id at it; the
    model's own tokenizer at a revision other than the model's is fetched so too (the model's
    Hub id becomes config.tokenizer). ValueError where there is no Hub tokenizer to pin."""
    revision = config.tokenizer_revision
    if revision is None:
        return
    if config.tokenizer is not None:
        if remote_source(config.tokenizer) != f"hf://{config.tokenizer}":
            raise ValueError(f"tokenizer_revision {revision!r} is a Hub revision; tokenizer "
                             f"{config.tokenizer!r} is not a Hub id ORG/NAME")
        return
    if not source.startswith("hf://"):
        raise ValueError(f"tokenizer_revision {revision!r} is a Hub revision; the tokenizer is "
                         f"model {config.model!r}'s, which is not on the Hub (name a Hub "
                         "tokenizer with tokenizer)")
    repo, _, model_revision = source.removeprefix("hf://").partition("@")
    if revision != (model_revision or "main"):
        config.tokenizer = repo


def resolve_config(config) -> None:
    """Pull a remote model of `config` (an EngineConfig) at its revision and point it at its
    cache folder, served under served_name() unless the config names one (in place, as
    EngineConfig.finalize fills the lengths); a local model's config stays as it is. Once pulled
    (model_source set) it is not looked at again. (A tokenizer named by a Hub id is left to
    transformers, which fetches only the tokenizer, at tokenizer_revision if given.)"""
    if config.model_source is not None:
        return
    source = with_revision(config.model, config.revision)
    _tokenizer_revision(config, remote_source(source) or source)
    path, name = resolve(source)
    if name is not None:
        config.model_source, config.model = config.model, path
        config.served_model_name = config.served_model_name or name


def local_lora(request, folders: dict[str, str]):
    """A LoRARequest whose adapter path is remote (a Hub id, hf://, s3://), pointed at its pulled
    cache folder (`folders`: remote path -> folder, the caller's memo, so a path is pulled once);
    a local one (or None) as it is."""
    if request is None or remote_source(request.lora_path) is None:
        return request
    folder = folders.get(request.lora_path)
    if folder is None:
        folder = folders[request.lora_path] = resolve(request.lora_path)[0]
    return dataclasses.replace(request, lora_path=folder)
