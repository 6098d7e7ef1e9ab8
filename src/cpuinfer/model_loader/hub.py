"""A model (or tokenizer) named by a Hugging Face id, resolved to a local directory through huggingface_hub,
as vLLM does: the local cache first (HF_HOME / HF_HUB_CACHE, or --download-dir), the hub when reachable and
HF_HUB_OFFLINE is not set, at --revision.

Only the files the engine reads are fetched: configs, tokenizer files, chat templates and safetensors
weights; never pickles (*.bin, *.pt) or Python code, since cpuinfer runs no remote code.
"""

from __future__ import annotations

import os
import re

from cpuinfer.errors import ModelLoadError

# What the loader reads of a Hugging Face repository (model_loader.hf_dir, gguf for a cached .gguf repo).
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]
# owner/name, as the hub spells repository ids (no path of its own: a relative path exists or is an error).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}$")


def looks_like_hub_id(name: str) -> bool:
    """True for 'owner/name' that could be a hub repository id (not ./x, /x, x.gguf, a/b/c)."""
    return bool(_HUB_ID.match(name)) and not name.endswith(".gguf") and ".." not in name


def resolve_model(
    name: str, revision: str | None = None, download_dir: str | None = None, flag: str = "--model"
) -> str:
    """A local path for `name`: itself when it exists, else the snapshot of the hub repository it names.

    Raises ValueError naming the id, the cache searched and whether the hub was asked, when it is neither."""
    if os.path.exists(name):
        return name
    if not looks_like_hub_id(name):
        raise ValueError(
            f"{flag} {name!r}: no such file or directory (give an HF model directory, a .gguf file or a "
            "Hugging Face model id such as HuggingFaceTB/SmolLM2-135M-Instruct)"
        )
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:
        raise ValueError(
            f"{flag} {name!r} is no local path; to fetch it as a Hugging Face id, pip install huggingface_hub"
        ) from None
    cache = download_dir or constants.HF_HUB_CACHE
    offline = bool(constants.HF_HUB_OFFLINE)
    at = f" at revision {revision!r}" if revision else ""
    try:
        path = snapshot_download(
            name,
            revision=revision,
            cache_dir=download_dir,
            allow_patterns=ALLOW_PATTERNS,
            local_files_only=offline,
        )
    except LocalEntryNotFoundError:
        how = "HF_HUB_OFFLINE is set, so the hub was not asked" if offline else "the hub could not be reached"
        raise ValueError(
            f"{flag} {name!r}{at}: not in the Hugging Face cache {cache}, and {how}. Download it where the hub is "
            "reachable (huggingface-cli download ...), point HF_HOME or --download-dir at a cache holding it, "
            "or pass a local directory."
        ) from None
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise ValueError(
            f"{flag} {name!r}: the hub has no such repository, or it is private or gated ({type(e).__name__}); "
            "check the id, or log in with HF_TOKEN"
        ) from None
    except RevisionNotFoundError:
        raise ValueError(f"{flag} {name!r}: the hub has no revision {revision!r} of it (--revision)") from None
    except (HfHubHTTPError, OSError) as e:
        raise ValueError(f"{flag} {name!r}{at}: downloading from the hub failed ({e}); cache: {cache}") from None
    return _model_file(path, name, flag)


def _model_file(snapshot: str, name: str, flag: str) -> str:
    """The snapshot directory of a safetensors model (or of a tokenizer), or the one .gguf file a cached GGUF
    repository holds."""
    files = os.listdir(snapshot)
    if {"config.json", "tokenizer.json"} & set(files) or any(f.endswith(".safetensors") for f in files):
        return snapshot
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if len(ggufs) == 1:
        return os.path.join(snapshot, ggufs[0])
    if ggufs:
        raise ValueError(
            f"{flag} {name!r}: the repository holds {len(ggufs)} .gguf files ({', '.join(ggufs[:4])}...); "
            "pass the path of the one to serve"
        )
    raise ModelLoadError(
        f"{flag} {name!r}: its snapshot {snapshot} holds no config.json, tokenizer.json, safetensors or .gguf file"
    )
