"""What the tests that run real programs need: a directory the unprivileged job user can pass through, a small OCI
image built from Debian's busybox, and a CDI spec for stand-in device nodes.

Podman is part of the project's setup (`make podman`, run by `make test`): a test that needs it fails saying what to
install rather than skipping (docs/operators.md, "Preparing a node")."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

IMAGE = "localhost/gpupool-test-busybox:1"
CDI_DIR = Path("/var/run/cdi")  # podman 4.3 reads CDI specs from /etc/cdi and /var/run/cdi only
INSTALL = ("install podman, runc and catatonit (`make podman`, or `apt-get install podman runc catatonit` as root): "
           "the container tests need them")


@contextlib.contextmanager
def passable_dir(prefix: str = "gpupool-test-"):
    """A fresh directory under /tmp that the job user (65534) can pass through (0711): pytest's own temporary
    directories are private to root, which a job running as nobody could not reach."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(d, 0o711)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def need_python3() -> str:
    """The interpreter a test program runs under as the job user: the system's python3 on the job's PATH (the
    project's own virtualenv may live under a directory the job user cannot reach)."""
    for p in ("/usr/local/bin/python3", "/usr/bin/python3", "/bin/python3"):
        if os.access(p, os.X_OK):
            return "python3"
    pytest.fail("no python3 in /usr/local/bin, /usr/bin or /bin for the job user to run: install Debian's python3")


def podman() -> str:
    exe = shutil.which("podman")
    if exe is None or shutil.which("runc") is None:
        pytest.fail(f"podman or runc missing: {INSTALL}")
    return exe


def busybox_image() -> str:
    """IMAGE, imported once from /bin/busybox (Debian's busybox or busybox-static) with a link per applet."""
    exe = podman()
    if subprocess.run([exe, "image", "exists", IMAGE], capture_output=True).returncode == 0:
        return IMAGE
    bb = shutil.which("busybox")
    if bb is None:
        pytest.fail("no busybox to build the test image from: apt-get install busybox-static (or busybox)")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "rootfs"
        (root / "bin").mkdir(parents=True)
        for d in ("tmp", "dev", "proc", "sys", "etc"):
            (root / d).mkdir()
        os.chmod(root / "tmp", 0o1777)
        shutil.copy2(bb, root / "bin" / "busybox")
        applets = subprocess.run([bb, "--list"], capture_output=True, text=True, check=True).stdout.split()
        for a in applets:
            if a != "busybox":
                with contextlib.suppress(FileExistsError):
                    (root / "bin" / a).symlink_to("busybox")
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        out = subprocess.run([exe, "import", "-", IMAGE], stdin=tar.stdout, capture_output=True, text=True)
        tar.wait()
        if out.returncode != 0 and subprocess.run([exe, "image", "exists", IMAGE]).returncode != 0:
            pytest.fail(f"podman import of the test image failed: {out.stderr[-500:]}")
    return IMAGE


@contextlib.contextmanager
def cdi_spec(uuids: list[str], where: Path):
    """A CDI spec (kind nvidia.com/gpu) naming one stand-in device node per card UUID: /dev/nvidia<i> in the
    container, a character device made under `where` on the host (the null device's numbers: harmless). Written to
    /var/run/cdi under a unique name and removed afterwards; UUIDs must be unique to the test (a name two specs
    define is a conflict CDI resolves by dropping it)."""
    devices = []
    for i, u in enumerate(uuids):
        node = where / f"stand-in-gpu{i}"
        if not node.exists():
            os.mknod(node, 0o666 | 0o020000, os.makedev(1, 3))
        devices.append({"name": u, "containerEdits": {"deviceNodes": [{"path": f"/dev/nvidia{i}",
                                                                        "hostPath": str(node)}]}})
    CDI_DIR.mkdir(parents=True, exist_ok=True)
    spec = CDI_DIR / f"gpupool-test-{uuid.uuid4().hex[:12]}.json"
    spec.write_text(json.dumps({"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": devices}))
    try:
        yield spec
    finally:
        spec.unlink(missing_ok=True)


def program_fleet(stack, roots: Path, nodes, gpus: int, **env: str) -> Path:
    """A worker and a simulated fleet of `nodes` (A100-80GB x `gpus` each) whose jobs run as real processes under
    `roots` (jobs/, checkpoints/), with `env` for the stack; the fleet's fault file (`lose:NODE` ...) is returned."""
    stack.extra_env.update({"GPUPOOL_JOBS_ROOT": str(roots / "jobs"),
                            "GPUPOOL_CHECKPOINT_ROOT": str(roots / "checkpoints"), **env})
    control = roots / "faults"
    control.write_text("")
    fleet = roots / "fleet.yaml"
    fleet.write_text("nodes:\n" + "".join(f"  - {{name: {n}, model: A100-80GB, gpus: {gpus}}}\n" for n in nodes))
    stack.start_worker()
    stack.start_agent(str(fleet), "--control", str(control))
    return control
