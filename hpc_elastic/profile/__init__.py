"""Model profiles: skew, throughput, the Γ(x) curve and the memory limit of a model on a device type.

Pure parts (no torch): :mod:`.skew` (Tiresias §3.3), :mod:`.curve` (Γ(x), LB-BSP §3.1/§3.3.1),
:mod:`.memory` (x^o search, LB-BSP §3.3.1(4)), :mod:`.options`, :mod:`.submit`; the schema in
:mod:`.schema` and the load/save/list API in :mod:`.store`. The measuring part, which imports torch, psutil
and pynvml lazily, is :mod:`.measure`.

The scheduler, the planners and LB-BSP use::

    from hpc_elastic.profile import find_profile, list_profiles, load_profile, placement_skew

    profile = load_profile("vgg_like@cpu-amd-epyc")          # by name, path, or unique model name
    profile = find_profile("vgg_like", "nvidia-h100")          # model x device type, or None
    profile.points / profile.gamma / profile.memory_limit      # C and Γ(x) per batch size, its fit, x^o
    profile.placement_skew                                     # S_J vs PACKLIMIT (largest tensor share)
    placement_skew("vgg_like@cpu-amd-epyc", directory)        # the scheduler's: a site profile, by name only
    profile.model.skew_for(4)                                  # round-robin PS-shard skew, in [1, K]
    profile.step_time(64), profile.gamma.launch_overhead_s, profile.memory_limit.batch_size   # Γ(64), Γ(0), x^o
"""

from hpc_elastic.profile.schema import (
    SCHEMA_VERSION,
    CurvePoint,
    DeviceInfo,
    DeviceKind,
    GammaFitInfo,
    MemoryLimitInfo,
    MemoryMethod,
    ModelInfo,
    Profile,
)
from hpc_elastic.profile.store import (
    MAX_PROFILE_BYTES,
    ProfileError,
    ProfileNotFound,
    default_profile_dir,
    find_profile,
    list_profiles,
    load_profile,
    parse_profile,
    placement_skew,
    profile_path,
    read_profile_file,
    save_profile,
    site_profile,
)

__all__ = [
    "MAX_PROFILE_BYTES",
    "SCHEMA_VERSION",
    "CurvePoint",
    "DeviceInfo",
    "DeviceKind",
    "GammaFitInfo",
    "MemoryLimitInfo",
    "MemoryMethod",
    "ModelInfo",
    "Profile",
    "ProfileError",
    "ProfileNotFound",
    "default_profile_dir",
    "find_profile",
    "list_profiles",
    "load_profile",
    "parse_profile",
    "placement_skew",
    "profile_path",
    "read_profile_file",
    "save_profile",
    "site_profile",
]
