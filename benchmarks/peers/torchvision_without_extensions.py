"""Writes a copy of a torchvision wheel without its compiled extensions, for a peer that imports torchvision.

The registry holds only CUDA builds of torchvision, whose extensions (``_C`` with its image and video ops, and the
CUDA libraries beside them) do not load on the CPU build of torch. The Python part imports without them: the
models, transforms and ``torchvision.ops`` written in Python work, the compiled ops (``nms``, ``roi_align``,
image decoding) do not, and no peer here uses them. AIMET imports torchvision for its model zoo hooks.

    python benchmarks/peers/torchvision_without_extensions.py WHEEL OUT_FOLDER   # prints the new wheel's path

Standard library only. The copy keeps the wheel's name and metadata, drops each ``.so`` file and its line in
``RECORD``, and empties ``torchvision/_meta_registrations.py``, which registers the compiled ops' shapes at import.
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

# torchvision registers shapes for its compiled ops at import, which fails where the ops are not there
STUB = '"""The meta registrations of the compiled ops, left out with the ops (torchvision_without_extensions.py)."""\n'


def strip(wheel: Path, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / wheel.name
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as copy:
        dropped = {name for name in source.namelist() if ".so" in Path(name).name}
        stubbed = {name for name in source.namelist() if name == "torchvision/_meta_registrations.py"}
        for info in source.infolist():
            if info.filename in dropped:
                continue
            data = source.read(info.filename) if info.filename not in stubbed else STUB.encode()
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = (
                    "\n".join(line for line in lines if line.split(",")[0] not in dropped | stubbed) + "\n"
                ).encode()
            copy.writestr(info, data)
    return target


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print(strip(Path(sys.argv[1]), Path(sys.argv[2])))
