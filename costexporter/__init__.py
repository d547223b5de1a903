"""costexporter: cost per valid step and wasted GPU-hours for distributed training."""

__version__ = "0.2.0.dev0"
