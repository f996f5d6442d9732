"""Build the Kafka broker's Docker image here, from Debian packages and Maven jars: nothing is pulled.

No image registry is reachable from this project's machines, so the image is made
from parts that are: a Debian root filesystem from ``debootstrap`` (Java 17 and
Python), the broker's jars from :mod:`rollout_journal.compose.broker.jars`, and the start script
:mod:`rollout_journal.compose.broker.entrypoint` with :mod:`rollout_journal.compose.broker.config`, the same
config code the jar launcher runs.

Two steps, each done once. The root filesystem becomes a base image by
``docker import`` (the same single layer as ``FROM scratch`` + ``ADD rootfs.tar``),
tagged by what went into it; then ``docker build`` adds the jars and scripts and
labels the image with a hash of its inputs. :func:`ensure_broker_image` skips
whatever is already there, so a warm rebuild costs one ``docker image inspect``.

Command line (stdlib only, so it runs before any virtual environment exists)::

    python3 -m rollout_journal.compose.broker.image build    # build the image if missing or stale; print its name
    python3 -m rollout_journal.compose.broker.image status   # say whether it is current, stale or missing
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rollout_journal.compose.broker.jars import POM_PATH, cache_root, ensure_broker_jars, kafka_version
from rollout_journal.compose.errors import LocalBrokerError

log = logging.getLogger(__name__)

IMAGE_ENV_VAR = "KAFKA_IMAGE"
MIRROR_ENV_VAR = "ROLLOUT_JOURNAL_DEBIAN_MIRROR"
BUILD_LABEL = "org.rollout-journal.build"
# bookworm is the Debian release that packages Java 17, whatever the host runs.
DEBIAN_SUITE = "bookworm"
DEBIAN_PACKAGES = ("openjdk-17-jre-headless", "python3")
# Left out of the base image: package caches, indexes and docs (about 190 MB).
_ROOTFS_EXCLUDES = (
    "./var/cache/apt/archives/*.deb",
    "./var/lib/apt/lists/*",
    "./usr/share/doc/*",
    "./usr/share/man/*",
    "./usr/share/locale/*",
)
_SCRIPTS = ("config.py", "entrypoint.py")  # of compose/broker/, copied with its package path
_DOCKERFILE = """\
FROM {base}
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
    PYTHONPATH=/opt/rollout-journal PYTHONDONTWRITEBYTECODE=1
COPY libs/ /opt/kafka/libs/
COPY rollout_journal/ /opt/rollout-journal/rollout_journal/
VOLUME /var/lib/kafka
ENTRYPOINT ["python3", "-m", "rollout_journal.compose.broker.entrypoint"]
"""
_DOCKER_TIMEOUT_S = 10


class DockerImageError(LocalBrokerError):
    """No Docker engine, or building the broker image failed; the message says which step."""


def image_name() -> str:
    """The broker image to build and run: ``$KAFKA_IMAGE``, else ``rollout-journal/kafka:<version>``."""
    return os.environ.get(IMAGE_ENV_VAR, "").strip() or f"rollout-journal/kafka:{kafka_version()}"


def base_image_name() -> str:
    """The Debian base image, tagged by what debootstrap put into it."""
    spec = "\n".join((DEBIAN_SUITE, *DEBIAN_PACKAGES, *_ROOTFS_EXCLUDES))
    return f"rollout-journal/debian-java:{DEBIAN_SUITE}-{hashlib.sha256(spec.encode()).hexdigest()[:12]}"


def build_hash() -> str:
    """A hash of everything the broker image is made of; its label says which build it is."""
    digest = hashlib.sha256(base_image_name().encode())
    digest.update(_DOCKERFILE.encode())
    digest.update(POM_PATH.read_bytes())
    for name in _SCRIPTS:
        digest.update(Path(__file__).with_name(name).read_bytes())
    return digest.hexdigest()


# --------------------------------------------------------------------------- the engine


def docker_cli() -> str:
    """Path of the ``docker`` command; :class:`DockerImageError` says what to install."""
    path = shutil.which("docker")
    if path is None:
        raise DockerImageError("`docker` not found on PATH: install Docker (Debian: `apt-get install docker.io`)")
    return path


def _docker(*args: str, timeout: float | None = _DOCKER_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [docker_cli(), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def engine_answers() -> bool:
    """Whether a Docker engine answers the CLI within a few seconds (the CLI knows about contexts)."""
    try:
        return _docker("info", "--format", "{{.ServerVersion}}").returncode == 0
    except (DockerImageError, subprocess.TimeoutExpired, OSError):
        return False


def image_build_label(image: str) -> str | None:
    """The build label of a local image; ``""`` for an image without one, None if there is no such image.

    Only the engine's local store is asked: nothing is pulled.
    """
    done = _docker("image", "inspect", "--format", f'{{{{index .Config.Labels "{BUILD_LABEL}"}}}}', image)
    if done.returncode != 0:
        return None
    label = done.stdout.strip()
    return "" if label == "<no value>" else label


@dataclass(frozen=True)
class ImageStatus:
    image: str
    state: str  # "current", "stale" (built from other inputs), "foreign" (not built here), "missing"

    @property
    def usable(self) -> bool:
        return self.state != "missing"


def image_status(image: str | None = None) -> ImageStatus:
    """Whether ``image`` (default :func:`image_name`) exists locally and was built from today's inputs."""
    image = image or image_name()
    label = image_build_label(image)
    if label is None:
        return ImageStatus(image, "missing")
    if label == "":
        return ImageStatus(image, "foreign")
    return ImageStatus(image, "current" if label == build_hash() else "stale")


# --------------------------------------------------------------------------- building


def ensure_broker_image(image: str | None = None, *, force: bool = False) -> str:
    """Build the broker image unless a current one exists; return its name.

    Needs a running Docker engine, and for the first build root, ``debootstrap``
    and a Debian mirror (the one apt uses, or ``$ROLLOUT_JOURNAL_DEBIAN_MIRROR``).
    """
    image = image or image_name()
    if not engine_answers():
        raise DockerImageError(
            "no Docker engine answers `docker info`: start one (as root: "
            "`dockerd --iptables=false --bridge=none &`) before building the broker image"
        )
    if not force and image_status(image).state == "current":
        log.info("broker image %s is current", image)
        return image
    libs = ensure_broker_jars()
    base = ensure_base_image()
    started = time.monotonic()
    work = cache_root() / "broker-image"
    work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="context-", dir=work) as tmp:
        context = Path(tmp)
        _link_tree(libs, context / "libs")
        scripts = context / "rollout_journal" / "compose" / "broker"
        scripts.mkdir(parents=True)
        (scripts.parent / "__init__.py").write_text("")  # rollout_journal stays a namespace package
        (scripts / "__init__.py").write_text("")
        for name in _SCRIPTS:
            shutil.copy2(Path(__file__).with_name(name), scripts / name)
        (context / "Dockerfile").write_text(_DOCKERFILE.format(base=base))
        done = _docker("build", "--label", f"{BUILD_LABEL}={build_hash()}", "--tag", image, str(context), timeout=600)
    if done.returncode != 0:
        raise DockerImageError(f"`docker build` of {image} failed (exit {done.returncode}):\n{_tail(done)}")
    log.info("built broker image %s in %.1f s", image, time.monotonic() - started)
    return image


def ensure_base_image() -> str:
    """Import the Debian root filesystem as a base image unless it exists; return its name."""
    base = base_image_name()
    if image_build_label(base) is not None:
        return base
    if os.geteuid() != 0:
        raise DockerImageError(f"building the base image {base} runs debootstrap, which needs root")
    debootstrap = shutil.which("debootstrap") or shutil.which("debootstrap", path="/usr/sbin:/sbin")
    if debootstrap is None:
        raise DockerImageError("`debootstrap` not found: install it (`apt-get install debootstrap`)")
    mirror = debian_mirror()
    work = cache_root() / "broker-image"
    work.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="rootfs-", dir=work))
    rootfs = tmp / "rootfs"
    started = time.monotonic()
    try:
        cmd = [
            debootstrap,
            "--variant=minbase",
            f"--include={','.join(DEBIAN_PACKAGES)}",
            DEBIAN_SUITE,
            str(rootfs),
            mirror,
        ]
        log.info("running %s", " ".join(cmd))
        with open(tmp / "debootstrap.log", "w") as out:
            code = subprocess.run(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, check=False
            ).returncode
        if code != 0:
            raise DockerImageError(
                f"debootstrap of Debian {DEBIAN_SUITE} from {mirror} failed (exit {code}):\n"
                + _tail_text((tmp / "debootstrap.log").read_text(errors="replace"))
            )
        log.info("debootstrap took %.1f s", time.monotonic() - started)
        _import_rootfs(rootfs, base)
    finally:
        _remove_rootfs(tmp)
    log.info("base image %s ready in %.1f s", base, time.monotonic() - started)
    return base


def _import_rootfs(rootfs: Path, tag: str) -> None:
    """``tar -C rootfs -c . | docker import - tag``, without the excluded caches."""
    tar_cmd = ["tar", "-C", str(rootfs), "-c", *(f"--exclude={p}" for p in _ROOTFS_EXCLUDES), "."]
    with subprocess.Popen(tar_cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL) as tar:
        assert tar.stdout is not None
        imported = subprocess.run(
            [docker_cli(), "import", "-", tag],
            stdin=tar.stdout,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        tar.stdout.close()
        tar_err = tar.stderr.read().decode(errors="replace") if tar.stderr else ""
    if tar.returncode != 0 or imported.returncode != 0:
        raise DockerImageError(
            f"importing the root filesystem as {tag} failed (tar exit {tar.returncode}, "
            f"docker import exit {imported.returncode}):\n{tar_err}{_tail(imported)}"
        )


def _remove_rootfs(tmp: Path) -> None:
    """Delete a debootstrap target, never crossing into a file system still mounted inside it.

    A debootstrap killed half-way can leave /proc, /sys or /dev mounted in its
    target; deleting through such a mount would delete the host's files.
    """
    prefix = str(tmp.resolve()) + "/"
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    for mount in sorted((m for m in mounts if m.startswith(prefix)), reverse=True):
        subprocess.run(["umount", "-l", mount], check=False, capture_output=True)
    done = subprocess.run(["rm", "-rf", "--one-file-system", str(tmp)], check=False, capture_output=True, text=True)
    if done.returncode != 0:
        log.warning("could not remove %s: %s", tmp, done.stderr.strip())


def debian_mirror() -> str:
    """The Debian mirror for debootstrap: ``$ROLLOUT_JOURNAL_DEBIAN_MIRROR``, else the one apt uses.

    apt itself is asked (``apt-get indextargets``) which repository serves the host
    release's ``main`` component, so every sources format it reads is covered.
    """
    configured = os.environ.get(MIRROR_ENV_VAR, "").strip()
    if configured:
        return configured
    codename = _os_release().get("VERSION_CODENAME", "")
    try:
        done = subprocess.run(
            [
                "apt-get",
                "indextargets",
                "--no-release-info",
                "--format",
                "$(REPO_URI) $(RELEASE) $(COMPONENT)",
                "Created-By: Packages",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            stdin=subprocess.DEVNULL,
        )
        lines = done.stdout.splitlines() if done.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired):
        lines = []
    for line in lines:
        parts = line.split()
        if len(parts) == 3 and parts[1] == codename and parts[2] == "main":
            return parts[0]
    raise DockerImageError(
        f"no Debian mirror found in apt's sources for release {codename or '(unknown)'}: "
        f"set {MIRROR_ENV_VAR} (e.g. http://deb.debian.org/debian)"
    )


def _os_release() -> dict[str, str]:
    try:
        text = Path("/etc/os-release").read_text()
    except OSError:
        return {}
    pairs = (line.partition("=") for line in text.splitlines())
    return {key: value.strip().strip('"') for key, sep, value in pairs if sep}


def _link_tree(source: Path, target: Path) -> None:
    """Hard-link the jars into the build context (a copy where linking is not possible)."""
    target.mkdir()
    for path in source.iterdir():
        if path.is_file():
            try:
                os.link(path, target / path.name)
            except OSError:
                shutil.copy2(path, target / path.name)


def _tail_text(text: str, lines: int = 30) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _tail(done: subprocess.CompletedProcess[str]) -> str:
    return _tail_text((done.stdout or "") + (done.stderr or ""))


# --------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m rollout_journal.compose.broker.image", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("command", choices=("build", "status"))
    parser.add_argument("--image", default=None, help=f"image name (default: ${IMAGE_ENV_VAR} or {image_name()})")
    parser.add_argument("--force", action="store_true", help="rebuild even if the image is current")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        if args.command == "build":
            print(ensure_broker_image(args.image, force=args.force))
            return 0
        if not engine_answers():
            print("no Docker engine answers", file=sys.stderr)
            return 1
        status = image_status(args.image)
        print(f"{status.image}: {status.state}")
        return 0 if status.state == "current" else 1
    except LocalBrokerError as exc:
        print(f"broker image: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
