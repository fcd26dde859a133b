"""Loading PET models the way the ecosystem does: uPET names, checkpoints, modules.

:func:`load_pet` returns a metatrain ``PET`` ``nn.Module`` (not TorchScript, so that
its Linear layers can be swapped) in evaluation mode, with frozen parameters and only
the energy heads. A uPET name such as ``"pet-mad-s"`` is resolved and downloaded by
``upet`` (cached by the Hugging Face hub client); offline, a previously cached file
is used, and without one the error says how to pass a local checkpoint.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import re
import socket
import sys
import tempfile
import warnings
from pathlib import Path
from urllib.parse import urlparse

import torch

UPET_MODELS = (
    "pet-mad-xs",
    "pet-mad-s",
    "pet-mad-m",
    "pet-omat-xs",
    "pet-omat-s",
    "pet-omat-m",
    "pet-omat-l",
    "pet-omat-xl",
    "pet-oam-l",
    "pet-oam-xl",
    "pet-omad-xs",
    "pet-omad-s",
    "pet-omad-l",
    "pet-omatpes-l",
    "pet-omol-s",
    "pet-omol-m",
    "pet-omol-l",
    "pet-mols-s",
    "pet-spice-s",
    "pet-spice-l",
)
"""Names upet 0.3 resolves (``upet._version.UPET_AVAILABLE_MODELS``), known offline."""

BUNDLED = {"pet-demo-chgnet": "pet-demo-chgnet.ckpt"}
"""Models shipped inside the package (``ase_tcfp32/data``), loaded with no network.

``pet-demo-chgnet``: a small PET (PET-MAD architecture rule, d_pet 64) distilled from the
CHGNet r2SCAN model on water, CO/Pt(111) and Cantor-alloy structures. A demo model for
examples, tests and validation, **not PET-MAD**; its accuracy is in ``docs/demo_model.md``."""

KEPT = ("energy", "non_conservative_force", "non_conservative_stress")
"""The targets :func:`load_pet` keeps (each in all its variants); others are removed."""

_UPET_REPO = "lab-cosmo/upet"
_CKPT_NAME = re.compile(r"^(?P<name>pet-[\w-]+?)-v?(?P<version>\d+\.\d+\.\d+)\.ckpt$")


class ModelDownloadError(RuntimeError):
    """A named model could not be downloaded and no cached copy exists."""


@contextlib.contextmanager
def _silenced_output():
    """Send what is written to file descriptors 1 and 2 in the block (by Python or by a
    library's C code) to a temporary file, shown only if the block raises."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile(mode="w+b") as sink:
        try:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            yield
        except BaseException:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[1], 2)
            sink.seek(0)
            sys.stderr.write(sink.read().decode(errors="replace"))
            raise
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def import_dependencies(metatomic_ase: bool = False) -> None:
    """Import the metatensor/metatomic/metatrain stack (and, when asked, metatomic-ase)
    without the notes it prints while importing: torch.jit deprecation warnings from
    metatensor's TorchScript code, and NVIDIA Warp's start-up banner (and, on machines
    without CUDA, its "driver not found" warning) through metatomic-ase's neighbor-list
    dependency. Imports that are already done cost nothing; the user's own warnings are
    untouched (the filter holds only for these imports)."""
    names = ["metatensor.torch", "metatomic.torch", "metatrain.pet", "metatrain.utils.io"]
    names += ["metatomic_ase"] if metatomic_ase else []
    if all(name in sys.modules for name in names):
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        for name in names:
            if name in sys.modules:
                continue
            if name == "metatomic_ase":
                with _silenced_output():
                    __import__(name)
            else:
                __import__(name)


def known_models() -> tuple[str, ...]:
    """The model names accepted by :func:`load_pet`: the bundled ones, then uPET's list
    (read from upet's ``_version.py`` without importing upet, whose import starts NVIDIA
    Warp and changes TorchScript's fusion strategy process-wide)."""
    spec = importlib.util.find_spec("upet")
    if spec is None or not spec.submodule_search_locations:
        return (*BUNDLED, *UPET_MODELS)
    path = Path(list(spec.submodule_search_locations)[0]) / "_version.py"
    namespace: dict = {}
    try:
        exec(compile(path.read_text(), str(path), "exec"), namespace)  # a file of plain lists
        return (*BUNDLED, *namespace["UPET_AVAILABLE_MODELS"])
    except (OSError, KeyError, SyntaxError):
        return (*BUNDLED, *UPET_MODELS)


def hub_reachable(timeout: float = 1.5) -> bool:
    """Whether the Hugging Face hub can be reached: False at once with ``HF_HUB_OFFLINE``
    set, else a TCP connection to its host within ``timeout`` seconds (without this a
    machine with no network waits ~25 s through the hub client's retries)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
    except OSError:
        return False
    return True


@contextlib.contextmanager
def _upet_imported_quietly():
    """Import upet's download code (for a real download only) without its banner, and
    undo the TorchScript fusion strategy its import sets for the whole process."""
    strategy = torch.jit.set_fusion_strategy([("STATIC", 2), ("DYNAMIC", 10)])  # returns the current one
    try:
        import_dependencies()
        with _silenced_output():
            from upet import _models
        yield _models
    finally:
        torch.jit.set_fusion_strategy(strategy)


def bundled_checkpoint(name: str) -> Path:
    """Path of a model shipped with the package."""
    from importlib.resources import files

    path = Path(str(files("ase_tcfp32") / "data" / BUNDLED[name]))
    if not path.is_file():
        raise FileNotFoundError(f"the bundled model file is missing from the installation: '{path}'")
    return path


def cached_checkpoints() -> dict[str, list[tuple[str, Path]]]:
    """uPET checkpoints in the local Hugging Face cache: ``{name: [(version, path)]}``."""
    try:
        from huggingface_hub import constants, scan_cache_dir

        repos = scan_cache_dir(constants.HF_HUB_CACHE).repos
    except Exception:  # no cache directory yet, or an unreadable one
        return {}
    found: dict[str, list[tuple[str, Path]]] = {}
    for repo in repos:
        if repo.repo_id != _UPET_REPO:
            continue
        for revision in repo.revisions:
            for file in revision.files:
                match = _CKPT_NAME.match(file.file_name)
                if match:
                    found.setdefault(match["name"], []).append((match["version"], file.file_path))
    for versions in found.values():
        versions.sort(key=lambda item: tuple(int(v) for v in item[0].split(".")))
    return found


def _download(name: str, version: str) -> Path:
    base, _, size = name.rpartition("-")
    try:
        if not hub_reachable():
            raise ConnectionError("the Hugging Face hub cannot be reached (offline, or HF_HUB_OFFLINE is set)")
        try:
            with _upet_imported_quietly() as upet_models:
                return Path(upet_models._resolve_and_download_checkpoint(base, size, version)[2])
        except ImportError as error:
            raise ModelDownloadError(
                f"downloading {name!r} needs the 'upet' package, which failed to import ({error}); "
                "install it with `pip install upet`, or pass a local checkpoint path"
            ) from error
    except (ValueError, ModelDownloadError):  # upet's own message for an unknown version
        raise
    except Exception as error:  # network, offline mode, hub errors
        cached = [(v, p) for v, p in cached_checkpoints().get(name, []) if version in ("latest", v)]
        if cached:
            v, path = cached[-1]
            warnings.warn(
                f"could not reach the model hub ({type(error).__name__}); using the cached {name} v{v} at {path}",
                stacklevel=4,
            )
            return Path(path)
        raise ModelDownloadError(
            f"could not download model {name!r} (version {version}) from the Hugging Face "
            f"hub: {type(error).__name__}: {error}. No cached copy was found. Pass a local "
            f"checkpoint instead, e.g. TCPETCalculator('/path/to/{name}-v1.6.0.ckpt'), "
            "after downloading it on a machine with network access, or use the bundled demo "
            "model TCPETCalculator('pet-demo-chgnet') (not PET-MAD: a small model for trying things out)."
        ) from error


def resolve_checkpoint(model: str | os.PathLike, version: str = "latest") -> Path:
    """The local checkpoint file for a uPET name or a path; raises a clear error otherwise."""
    text = os.fspath(model)
    path = Path(text).expanduser()
    if path.is_file():
        return path
    if text in BUNDLED:
        return bundled_checkpoint(text)
    if text in known_models():
        return _download(text, version)
    if path.suffix or os.sep in text or path.exists():
        raise FileNotFoundError(f"model checkpoint not found: '{path}'")
    raise ValueError(f"unknown model {text!r}: pass a checkpoint path or one of {', '.join(known_models())}")


def _read_checkpoint(path: Path) -> torch.nn.Module:
    import_dependencies()
    from metatrain.utils.io import load_model

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="PET assumes that Cartesian tensors")
            return load_model(path)
    except Exception as error:
        raise ValueError(f"could not read a metatrain checkpoint from '{path}': {error}") from error


def _unwrap_pet(module: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """The metatrain PET in ``module`` and the LLPR model wrapping it (None if none)."""
    from metatomic.torch import AtomisticModel
    from metatrain.pet import PET

    if isinstance(module, AtomisticModel):
        module = module.module
    wrapper = None
    inner = getattr(module, "model", None)  # LLPR-wrapped releases (PET-MAD)
    if isinstance(inner, PET):
        module, wrapper = inner, module
    if not isinstance(module, PET):
        raise TypeError(f"expected a metatrain PET model (or an LLPR model wrapping one), got {type(module).__name__}")
    return module, wrapper


def load_pet(model: str | os.PathLike | torch.nn.Module, version: str = "latest") -> torch.nn.Module:
    """A metatrain ``PET`` in eval mode, frozen, keeping only the outputs a calculator
    reads: the energy and the direct force and stress heads, in every variant.

    ``model`` is a uPET name (``"pet-mad-s"``), a checkpoint path, or a loaded
    metatrain model (PET, LLPR-wrapped PET, or an unscripted ``AtomisticModel``).
    A module passed in is modified in place (heads dropped, parameters frozen).
    """
    return load_model(model, version)[0]


def load_model(
    model: str | os.PathLike | torch.nn.Module, version: str = "latest"
) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """:func:`load_pet`'s PET, and the LLPR model that wrapped it in the checkpoint (its
    uncertainty calibration: :class:`ase_tcfp32._heads.LLPR`), or None."""
    import_dependencies()
    if isinstance(model, torch.nn.Module):
        pet, wrapper = _unwrap_pet(model)
    else:
        pet, wrapper = _unwrap_pet(_read_checkpoint(resolve_checkpoint(model, version)))
    for target in list(pet.output_shapes):
        if target.split("/")[0] not in KEPT:
            pet.remove_output(target)
    if "energy" not in pet.output_shapes:
        raise ValueError("this PET model has no 'energy' output")
    for parameter in pet.parameters():
        parameter.requires_grad_(False)
    return pet.eval(), wrapper
