#!/usr/bin/env python3
"""Builds an OCI image archive (image-layout tar, as `ctr images import` and `docker load` read it)
from files on this machine, without a Docker daemon. Each executable brings its shared-library
closure (what `ldd` resolves), so an image is the built binaries and the libraries they run with.
Layers are uncompressed and reproducible (sorted entries, mtime 0, root-owned).

  oci.py --out worker.tar --name localhost/shardserve/worker:dev \
         --exe build/bin/shardserve-worker:/usr/local/bin/shardserve-worker \
         --entrypoint '["shardserve-worker"]' --cmd '["launch"]' --user 65532:65532 \
         --dir /models --port 8000

Libraries outside the standard directories (the CUDA wheels' under the cache, say) go to
/usr/lib/x86_64-linux-gnu in the image, where the dynamic loader looks by default. The first layer
holds the libraries and the base files, the second the executables, so a rebuild of the binaries
changes only the small layer.
"""
import argparse
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile

STANDARD_LIB_DIRS = ("/lib/", "/lib64/", "/usr/lib/")
LIB_DIR = "/usr/lib/x86_64-linux-gnu"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def closure(exe):
    """{path in the image: path here} of every shared library `exe` loads, the loader included."""
    out = subprocess.run(["ldd", exe], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"oci.py: ldd {exe}: {out.stderr.strip() or out.stdout.strip()}")
    libs = {}
    for line in out.stdout.splitlines():
        parts = line.split()
        if "=>" in parts:
            target = parts[parts.index("=>") + 1]
            if target == "not":
                sys.exit(f"oci.py: {exe} needs {parts[0]}, which is not found here")
            name = parts[0]
        elif parts and parts[0].startswith("/"):
            target, name = parts[0], os.path.basename(parts[0])
        else:
            continue  # linux-vdso
        if not target.startswith("/"):
            continue
        inside = target if target.startswith(STANDARD_LIB_DIRS) else f"{LIB_DIR}/{name}"
        libs[inside] = os.path.realpath(target)
    return libs


def passwd_files(user):
    uid, _, gid = user.partition(":")
    gid = gid or uid
    return {
        "/etc/passwd": f"root:x:0:0:root:/root:/sbin/nologin\n"
                       f"nonroot:x:{uid}:{gid}:nonroot:/home/nonroot:/sbin/nologin\n",
        "/etc/group": f"root:x:0:\nnonroot:x:{gid}:\n",
        "/etc/nsswitch.conf": "passwd: files\ngroup: files\nhosts: files dns\n",
    }


class Layer:
    """A reproducible tar layer built in a temporary file; parents are added as directories."""

    def __init__(self):
        self.file = tempfile.TemporaryFile()
        self.entries = {}  # path inside -> (kind, source or bytes, mode)

    def add_dir(self, path, mode=0o755):
        path = path.rstrip("/") or "/"
        while path not in ("/", "") and path not in self.entries:
            self.entries[path] = ("dir", None, mode)
            mode = 0o755
            path = os.path.dirname(path)

    def add_file(self, path, source, mode=None):
        self.add_dir(os.path.dirname(path))
        self.entries[path] = ("file", source, mode)

    def add_bytes(self, path, data, mode=0o644):
        self.add_dir(os.path.dirname(path))
        self.entries[path] = ("bytes", data.encode(), mode)

    def write(self):
        """(digest, size) of the finished tar."""
        with tarfile.open(fileobj=self.file, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for path in sorted(self.entries):
                kind, src, mode = self.entries[path]
                info = tarfile.TarInfo(path.lstrip("/"))
                info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                if kind == "dir":
                    info.type, info.mode = tarfile.DIRTYPE, mode
                    tar.addfile(info)
                elif kind == "bytes":
                    info.size, info.mode = len(src), mode
                    tar.addfile(info, io.BytesIO(src))
                else:
                    st = os.stat(src)
                    info.size = st.st_size
                    info.mode = mode if mode is not None else (st.st_mode & 0o755)
                    with open(src, "rb") as f:
                        tar.addfile(info, f)
        self.file.seek(0)
        h, size = hashlib.sha256(), 0
        for chunk in iter(lambda: self.file.read(1 << 20), b""):
            h.update(chunk)
            size += len(chunk)
        self.file.seek(0)
        return "sha256:" + h.hexdigest(), size


def add_blob(tar, data_or_file, digest, size):
    info = tarfile.TarInfo("blobs/sha256/" + digest.split(":", 1)[1])
    info.size, info.mode = size, 0o644
    tar.addfile(info, data_or_file if hasattr(data_or_file, "read") else io.BytesIO(data_or_file))


def json_blob(obj):
    data = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return data, "sha256:" + hashlib.sha256(data).hexdigest(), len(data)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", action="append", required=True,
                    help="full image reference; repeat for more tags of the same image")
    ap.add_argument("--exe", action="append", default=[],
                    help="SRC:DST, an executable and its shared-library closure")
    ap.add_argument("--file", action="append", default=[], help="SRC:DST, one file as it is")
    ap.add_argument("--dir", action="append", default=[], help="an empty directory (mount point)")
    ap.add_argument("--entrypoint", default="null")
    ap.add_argument("--cmd", default="null")
    ap.add_argument("--user", default="")
    ap.add_argument("--env", action="append", default=[])
    ap.add_argument("--port", action="append", default=[])
    args = ap.parse_args()

    base, top = Layer(), Layer()
    if args.user:
        for path, text in passwd_files(args.user).items():
            base.add_bytes(path, text)
    base.add_dir("/tmp", 0o1777)
    for d in args.dir:
        base.add_dir(d)
    for spec in args.exe:
        src, dst = spec.split(":", 1)
        for inside, here in closure(src).items():
            base.add_file(inside, here, 0o755)
        top.add_file(dst, src, 0o755)
    for spec in args.file:
        src, dst = spec.split(":", 1)
        top.add_file(dst, src)
    layers = [layer.write() for layer in (base, top)]

    config = {
        "architecture": "amd64", "os": "linux", "created": "1970-01-01T00:00:00Z",
        "config": {"Env": [f"PATH={PATH}"] + args.env, "Entrypoint": json.loads(args.entrypoint),
                   "Cmd": json.loads(args.cmd), "User": args.user, "WorkingDir": "/",
                   "ExposedPorts": {f"{p}/tcp": {} for p in args.port}},
        "rootfs": {"type": "layers", "diff_ids": [d for d, _ in layers]},
    }
    config_data, config_digest, config_size = json_blob(config)
    manifest = {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": config_digest, "size": config_size},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d, "size": s}
                   for d, s in layers],
    }
    manifest_data, manifest_digest, manifest_size = json_blob(manifest)
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
             "manifests": [{"mediaType": manifest["mediaType"], "digest": manifest_digest,
                            "size": manifest_size,
                            "platform": {"architecture": "amd64", "os": "linux"},
                            "annotations": {"io.containerd.image.name": name,
                                            "org.opencontainers.image.ref.name":
                                                name.rsplit(":", 1)[-1]}}
                           for name in args.name]}

    tmp = args.out + ".tmp"
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in (("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'),
                           ("index.json", json.dumps(index).encode())):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
        add_blob(tar, config_data, config_digest, config_size)
        add_blob(tar, manifest_data, manifest_digest, manifest_size)
        for layer, (digest, size) in zip((base, top), layers):
            add_blob(tar, layer.file, digest, size)
    os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
