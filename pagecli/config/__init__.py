"""Settings (engine, sampling) and the TOML profiles that fill them in. Knows nothing of torch."""

from pagecli.config.profiles import Profile, RunSettings, available_profiles, load_profile
from pagecli.config.settings import EngineConfig, SamplingParams

__all__ = ["EngineConfig", "Profile", "RunSettings", "SamplingParams", "available_profiles", "load_profile"]
