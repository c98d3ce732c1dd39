"""The transformers releases whose serving stacks ``specfit serve`` runs on, and what an unsupported one is told."""

from __future__ import annotations

SUPPORTED = {"5.24": "seam_524", "5.25": "seam_525"}  # minor release -> its seam module (serving/)
PIP = "pip install 'transformers>=5.24,<5.26'"


def minor(version: str) -> str:
    """ "5.25.0" -> "5.25" """
    return ".".join(version.split(".")[:2])


def unsupported(version: str, detail: str = "") -> ImportError:
    """The error an import of the server raises on a release it was not written for (or one missing a name its seam
    needs): the installed version, the releases that work, the pip command."""
    why = f" ({detail})" if detail else ""
    return ImportError(f"specfit serve runs on transformers' serving stacks of {' and '.join(SUPPORTED)}; the "
                       f"installed transformers {version} does not have it{why}. Install a supported release: {PIP}")
