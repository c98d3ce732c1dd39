"""How a model is offloaded: slots per layer, cache mode and policy, emulated link, where cold experts are computed,
emulated host lane, pinning. No torch here."""

from __future__ import annotations

from dataclasses import dataclass

from .cold import check_cold
from .host_lane import HostConfig
from .link import LinkConfig
from .policies import DEFAULT, check_policy

CACHE_MODES = ("cached", "cleared")


@dataclass(frozen=True)
class OffloadConfig:
    cache_slots: int  # expert slots per MoE layer on the compute device
    cache_mode: str = "cached"  # "cleared": empty every slot before each forward (the paper's vanilla baseline)
    link: LinkConfig | None = None  # emulated host link (CPU studies); None = real copies only
    pin: bool | str = "auto"
    # experts that miss the slot cache: "copy" (into a slot), "host" (computed on the host CPU), "auto" (per expert,
    # by predicted time; offload/cold.py). enable() defaults it to "auto" where a host lane exists, else "copy"
    cold: str = "copy"
    host: HostConfig | None = None  # emulated host lane (CPU studies); None = the real host (CUDA) or none (CPU)
    cache_policy: str = DEFAULT  # which expert a load evicts (offload/policies.py)

    def __post_init__(self):
        if self.cache_mode not in CACHE_MODES:
            raise ValueError(f"cache_mode must be one of {CACHE_MODES}, got {self.cache_mode!r}")
        if self.link is not None and not isinstance(self.link, LinkConfig):
            raise ValueError(f"link must be a LinkConfig or None, got {self.link!r}")
        check_cold(self.cold)
        if self.host is not None and not isinstance(self.host, HostConfig):
            raise ValueError(f"host must be a HostConfig or None, got {self.host!r}")
        check_policy(self.cache_policy)
