"""The accounting core (pure: numpy, no Redis, HTTP, CLI or NVML): samples to bands, events to a
timeline, slices to categories, GPU-hours and energy to money, and the live agent's incremental
form of the same rules. Everything here runs and is tested without a service."""
