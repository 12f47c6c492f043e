"""The container image of deploy/container/Containerfile, built for real where podman is
installed, then used the way the DaemonSet uses it: the image's own cubefs-fuse mounts a
volume through /dev/fuse, serves a read and unmounts with the image's fusermount3.

Registries may be unreachable (no ``debian:12`` to pull): the base image is then a local
Debian 12 made with mmdebstrap from the Debian mirror and ``podman import``-ed as
BASE_TAG (kept, so the next run reuses it and the build's layer cache).  Without podman,
or without any way to a base image, the test skips and says why.  podman's build cache
(layers, and pip's cache mount) makes a rebuild take seconds.  Every build leaves its compile
stage's images untagged (650-760 MB each as podman lists them); the test removes those of earlier builds
(the stage is labelled BUILD_STAGE_LABEL), so repeated runs do not fill the disk.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml  # type: ignore[import-untyped]

from cubefs_fuse import __version__
from tests.helpers import REPO

CONTAINERFILE = REPO / "deploy" / "container" / "Containerfile"
DAEMONSET = REPO / "deploy" / "k8s" / "daemonset.yaml"
# The image name the DaemonSet runs and the docs tell operators to build (and push).
IMAGE = f"registry.example.com/cubefs-fuse:{__version__}"
TEST_TAG = "localhost/cubefs-fuse:test"
BASE_TAG = "localhost/cubefs-fuse-base:debian12"
# The host's CA bundle, handed to pip inside the build (a TLS-inspecting proxy signs with a
# CA that only the host trusts); build-time only, it does not reach the image.
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
# apt and pip downloads plus a compile of the C session: minutes on a loaded 2-core machine.
BUILD_TIMEOUT = 900
# The Containerfile's compile stage carries this label (its images are untagged by design).
BUILD_STAGE_LABEL = "io.cubefs-fuse.stage=build"


def test_the_daemonset_runs_the_image_the_containerfile_builds() -> None:
    daemonset = yaml.safe_load(DAEMONSET.read_text())
    [container] = daemonset["spec"]["template"]["spec"]["containers"]
    assert container["image"] == IMAGE
    build_line = f"podman build -f deploy/container/Containerfile -t {IMAGE} ."
    for doc in (CONTAINERFILE, REPO / "deploy" / "README.md", REPO / "docs" / "operations.md"):
        assert build_line in doc.read_text(), f"{doc.name} does not show how {IMAGE} is built"
    text = CONTAINERFILE.read_text()
    stages = [line for line in text.splitlines() if line.startswith("FROM ")]
    assert len(stages) == 2 and " AS build" in stages[0]  # compile stage, runtime stage
    runtime = text[text.rindex(stages[1]):]
    assert " fuse3" in runtime and "libfuse3-dev" not in runtime and "gcc" not in runtime
    assert "fusermount3 --version" in runtime  # the build fails without it


def _podman() -> str:
    podman = shutil.which("podman")
    if podman is None:
        pytest.skip("no container builder: install podman (Debian: apt install podman) to build the image")
    return podman


def _exists(podman: str, image: str) -> bool:
    return subprocess.run([podman, "image", "exists", image], capture_output=True).returncode == 0


def _stage_images(podman: str) -> set[str]:
    """The IDs of every image of the Containerfile's compile stage (by its label)."""
    result = subprocess.run([podman, "images", "-a", "-q", "--no-trunc", "--filter", f"label={BUILD_STAGE_LABEL}"],
                            capture_output=True, text=True, check=True)
    return {line.strip() for line in result.stdout.splitlines() if line.strip()}


def _chain(podman: str, image: str) -> set[str]:
    """``image`` and the images below it (its layer cache), as ``sha256:`` IDs, by the
    images' Parent links (``podman history`` shows some intermediate images as missing)."""
    chain: set[str] = set()
    while image and image not in chain:
        chain.add(image)
        result = subprocess.run([podman, "image", "inspect", "--format", "{{.Parent}}", image], capture_output=True,
                                text=True)
        image = result.stdout.strip() if result.returncode == 0 else ""
    return {i if i.startswith("sha256:") else f"sha256:{i}" for i in chain}


def _image_id(podman: str, image: str) -> str:
    result = subprocess.run([podman, "image", "inspect", "--format", "{{.Id}}", image], capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else ""


def _base_image(podman: str, tmp_path: Path) -> str:
    """A Debian 12 base image in local storage: given, pulled earlier, or made here."""
    for candidate in (os.environ.get("CUBEFS_FUSE_BASE_IMAGE"), "docker.io/library/debian:12", BASE_TAG):
        if candidate and _exists(podman, candidate):
            return candidate
    mmdebstrap = shutil.which("mmdebstrap")
    if mmdebstrap is None:
        pytest.skip("no base image available: debian:12 is not in local storage (registries may be "
                    "unreachable) and mmdebstrap is not installed to make one from the Debian mirror; "
                    "set CUBEFS_FUSE_BASE_IMAGE or apt install mmdebstrap")
    tarball = tmp_path / "debian12.tar"
    result = subprocess.run([mmdebstrap, "--variant=minbase", "--mode=root", "bookworm", str(tarball)],
                            capture_output=True, text=True, timeout=BUILD_TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    subprocess.run([podman, "import", str(tarball), BASE_TAG], capture_output=True, check=True, timeout=300)
    return BASE_TAG


def _build(podman: str, *args: str, cwd: Path) -> str:
    # chroot isolation: builds where an OCI runtime may not set rlimits (nested sandboxes);
    # it needs the host network, which is what a build uses anyway.
    command = [podman, "build", "--pull=never", "--isolation=chroot", "--network=host", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT, cwd=cwd)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def test_containerfile_builds_an_image_that_mounts(tmp_path: Path) -> None:
    podman = _podman()
    base = _base_image(podman, tmp_path)
    ca = ["-v", f"{HOST_CA}:/run/host-ca.crt:ro", "--build-arg", "PIP_CERT=/run/host-ca.crt"] \
        if HOST_CA.is_file() else []
    previous = _image_id(podman, TEST_TAG)
    started = _stage_images(podman)
    build_args = ["-f", str(CONTAINERFILE), "--build-arg", f"BASE={base}", *ca]
    _build(podman, *build_args, "-t", TEST_TAG, ".", cwd=REPO)
    if previous and previous != _image_id(podman, TEST_TAG):  # the last run's image, now untagged
        subprocess.run([podman, "rmi", previous], capture_output=True)
    # The compile stage's images of earlier builds, except those this build used (the next
    # build's layer cache): the stage rebuilt alone is all cache hits (seconds) and names its
    # image, whose Parent links are the chain this build used.
    stage = _build(podman, *build_args, "--target", "build", "-q", ".", cwd=REPO).split()[-1]
    stale = started - _chain(podman, stage)
    for image in sorted(stale, key=lambda i: -len(_chain(podman, i))):  # children first
        subprocess.run([podman, "rmi", image], capture_output=True)
    assert not stale & _stage_images(podman), "compile-stage images of earlier builds were not removed"
    print(f"container image: built {TEST_TAG} from {base}")
    [info] = json.loads(subprocess.run([podman, "image", "inspect", TEST_TAG], capture_output=True, text=True,
                                       check=True).stdout)
    env = dict(e.partition("=")[::2] for e in info["Config"]["Env"])
    assert env["PATH"].startswith("/opt/cubefs-fuse/bin:") and "PIP_CERT" not in env

    # The image as the DaemonSet uses it (privileged: SYS_ADMIN and /dev/fuse): mount a
    # volume from the image's example config, read through it, unmount with fusermount3.
    (tmp_path / "Containerfile").write_text(f"""FROM {TEST_TAG}
RUN ! command -v gcc && ! python3 -c 'import torch' 2>/dev/null \\
    && test -f /opt/cubefs-fuse/lib/python3.11/site-packages/cubefs_fuse/py.typed \\
    && command -v fusermount3 && mkdir -p /srcdir /mnt/v && echo served > /srcdir/a \\
    && cubefs-fuse example-config | python3 -c 'import json, sys; c = json.load(sys.stdin); \\
c.update(mountPoint="/mnt/v", source="/srcdir", diskCacheDir="/tmp/cache"); json.dump(c, open("/c.json", "w"))' \\
    && (cubefs-fuse mount -c /c.json || (cat /var/log/cubefs-fuse/*.log; false)) \\
    && test "$(cat /mnt/v/a)" = served && cubefs-fuse umount /mnt/v && echo IMAGE-MOUNT-OK
""")
    out = _build(podman, "--cap-add=SYS_ADMIN", "--device=/dev/fuse", "-t", "localhost/cubefs-fuse-check:test", ".",
                 cwd=tmp_path)
    assert "IMAGE-MOUNT-OK" in out and "unmounted /mnt/v" in out, out[-3000:]
    subprocess.run([podman, "rmi", "localhost/cubefs-fuse-check:test"], capture_output=True)
