"""Checkpoints named as users name them: a Hugging Face hub name, downloaded through
huggingface_hub (its progress bars, HF_TOKEN, HF_HUB_OFFLINE and cache), with only the
files the engine reads: configs, tokenizer files, and one weight format (safetensors
when the repository has them, else PyTorch .bin)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                    RepositoryNotFoundError, RevisionNotFoundError)

CONFIG_PATTERNS = ["*.json", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
WEIGHT_FORMATS = (["*.safetensors"], ["*.bin"])  # tried in this order
# Duplicates of the weights some repositories carry (Mistral's consolidated file, Llama 3's
# original/ folder for Meta's own code): never downloaded.
IGNORED_PATTERNS = ["consolidated*", "original/*"]


@dataclass(frozen=True)
class HubOptions:
    """How to fetch a hub model: revision (branch, tag or commit; None: main), download_dir
    (the HF cache folder; None: HF_HOME's), token (None: HF_TOKEN or the saved login)."""

    revision: str | None = None
    download_dir: str | None = None
    token: str | None = None


def hub_snapshot(name: str, options: HubOptions) -> Path:
    """The local folder of ``name`` at ``options.revision``, downloading what is missing
    (nothing when HF_HUB_OFFLINE is set). Raises FileNotFoundError with the reason."""
    try:
        for weights in WEIGHT_FORMATS:
            folder = _snapshot(name, options, CONFIG_PATTERNS + weights)
            if any(folder.glob(pattern) for pattern in weights):
                return folder
    except (LocalEntryNotFoundError, FileNotFoundError) as error:
        raise FileNotFoundError(_not_available(name, options)) from error
    except GatedRepoError as error:
        raise FileNotFoundError(f"model {name!r} is gated: accept its license on the hub and pass "
                                "hf_token= (or set HF_TOKEN)") from error
    except RepositoryNotFoundError as error:
        raise FileNotFoundError(f"model {name!r} is neither a local folder nor a hub repository "
                                "(or it is private: pass hf_token= or set HF_TOKEN)") from error
    except RevisionNotFoundError as error:
        raise FileNotFoundError(f"model {name!r} has no revision {options.revision!r}") from error
    except HfHubHTTPError as error:
        raise FileNotFoundError(f"downloading {name!r} failed: {error}") from error
    raise FileNotFoundError(f"model {name!r} has neither *.safetensors nor *.bin weights")


def _snapshot(name: str, options: HubOptions, patterns: list[str]) -> Path:
    return Path(snapshot_download(
        name, revision=options.revision, cache_dir=options.download_dir, token=options.token,
        allow_patterns=patterns, ignore_patterns=IGNORED_PATTERNS, local_files_only=constants.HF_HUB_OFFLINE))


def _not_available(name: str, options: HubOptions) -> str:
    where = f"the Hugging Face cache ({options.download_dir or constants.HF_HUB_CACHE})"
    revision = f" at revision {options.revision!r}" if options.revision else ""
    if constants.HF_HUB_OFFLINE:
        return (f"model {name!r}{revision} is not in {where}, and HF_HUB_OFFLINE is set: download it "
                "once with the hub reachable (or unset HF_HUB_OFFLINE), or pass a local folder")
    return f"model {name!r}{revision} could not be downloaded (is the hub reachable?) and is not in {where}"
