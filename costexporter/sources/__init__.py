"""Where samples come from: recorded trace files (here), NVML, dcgm-exporter, simulation."""
