"""`costexporter serve --source nvml` in a real process on a machine without a GPU.

python nvml_serve.py N_GPUS [serve options...]: pynvml's functions are replaced by the fake of
tests/fake_nvml.py (N_GPUS B300s at compute power), then the real CLI runs.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pynvml

from tests.fake_nvml import FakeGpu, FakeNvml


def uuid(i: int) -> str:
    return f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}"


if __name__ == "__main__":
    fake = FakeNvml([FakeGpu(uuid(i)) for i in range(int(sys.argv[1]))])
    for name in FakeNvml.FUNCTIONS:
        setattr(pynvml, name, getattr(fake, name))
    from costexporter.cli.main import run

    sys.argv = ["costexporter", "serve", "--source", "nvml", *sys.argv[2:]]
    run()
