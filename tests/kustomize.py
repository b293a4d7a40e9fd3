"""A small kustomize renderer for the tests: what k8s/ uses, nothing more.

Supports a kustomization's ``resources`` (files, and directories holding a
kustomization.yaml), ``namespace``, ``images`` (newName/newTag/digest on every container
and initContainer, in any kind) and ``patches`` selected by kind and name, either in JSON
6902 form (add, replace, remove, test) or as the one strategic-merge patch that removes an
object (``$patch: delete`` naming the target's kind and name, nothing else). Anything else
in a kustomization is refused, so k8s/
cannot start using a feature these tests would silently ignore.

The real tool's output is kept in the repo (``RENDERED``: one file per kustomization, made
by ``make k8s-rendered`` where ``kubectl`` or ``kustomize`` is installed, with the tool's
version and the digest of k8s/ it was made from): tests/unit/test_k8s.py checks that this
renderer gives the same objects, and that k8s/ has not changed since the files were made,
on any machine, the tool installed or not (the README's install cannot provide it).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests import tools

Doc = dict[str, Any]
SUPPORTED = {"apiVersion", "kind", "resources", "namespace", "images", "patches"}


class KustomizeError(Exception):
    """The kustomization uses something this renderer does not support, or a patch fails."""


def load_docs(path: Path) -> list[Doc]:
    """The YAML documents of a file, empty ones dropped."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def render(directory: Path) -> list[Doc]:
    """The objects the kustomization in ``directory`` produces."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - SUPPORTED
    if unknown:
        raise KustomizeError(f"{directory}: unsupported kustomization fields {sorted(unknown)}")
    docs: list[Doc] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        docs.extend(render(path) if path.is_dir() else load_docs(path))
    for patch in kustomization.get("patches", []):
        _apply_patch(docs, patch, directory)
    for image in kustomization.get("images", []):
        for doc in docs:
            _set_images(doc, image)
    if "namespace" in kustomization:
        for doc in docs:
            doc.setdefault("metadata", {})["namespace"] = kustomization["namespace"]
    return docs


def real_tool() -> list[str] | None:
    """The command of an installed kustomize (kubectl's built-in one first), if any."""
    if tools.system_tool_available("kubectl"):
        return ["kubectl", "kustomize"]
    if tools.system_tool_available("kustomize"):
        return ["kustomize", "build"]
    return None


def render_with_real_tool(directory: Path, tool: list[str]) -> list[Doc]:
    done = subprocess.run([*tool, str(directory)], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise KustomizeError(f"{' '.join(tool)} {directory}: {done.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "k8s"
RENDERED = Path(__file__).resolve().parent / "k8s_rendered"
"""The real kustomize's output of every kustomization below, one file each."""


def kustomizations() -> dict[str, Path]:
    """Every kustomization users apply, by the name of its rendered file."""
    found = {f"overlays-{p.name}": p for p in (K8S / "overlays").iterdir()
             if (p / "kustomization.yaml").is_file()}
    found |= {f"trainer-v2-{p.name}": p for p in (K8S / "trainer-v2").iterdir()
              if p.name != "base" and (p / "kustomization.yaml").is_file()}
    return dict(sorted(found.items()))


def k8s_digest() -> str:
    """sha256 over every file of k8s/ but its READMEs (path and bytes): what the rendered
    files were made from."""
    digest = hashlib.sha256()
    for path in sorted(p for p in K8S.rglob("*") if p.is_file() and p.suffix != ".md"):
        digest.update(str(path.relative_to(K8S)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def rendered_file(name: str) -> tuple[str, list[Doc]]:
    """The kept output of the real tool for kustomization ``name``: (the digest of k8s/ it
    was made from, its objects)."""
    text = (RENDERED / f"{name}.yaml").read_text()
    header = text.splitlines()[1]
    return header.removeprefix("# from k8s/ at sha256 "), \
        [doc for doc in yaml.safe_load_all(text) if doc]


def write_rendered(tool: list[str]) -> list[str]:
    """Render every kustomization with the real ``tool`` into ``RENDERED``, after checking
    that this renderer agrees; the files written."""
    version = subprocess.run([*tool[:1], "version", "--client"] if tool[0] == "kubectl"
                             else [tool[0], "version"], capture_output=True, text=True,
                             timeout=60).stdout.strip().replace("\n", "; ")
    RENDERED.mkdir(exist_ok=True)
    digest, written = k8s_digest(), []
    for name, directory in kustomizations().items():
        docs = render_with_real_tool(directory, tool)
        if by_kind_and_name(docs) != by_kind_and_name(render(directory)):
            raise KustomizeError(f"{directory}: this renderer and {' '.join(tool)} disagree")
        path = RENDERED / f"{name}.yaml"
        path.write_text(
            f"# {' '.join(tool)} {directory.relative_to(REPO)} ({version})\n"
            f"# from k8s/ at sha256 {digest}\n"
            f"# made by `make k8s-rendered`; tests/unit/test_k8s.py compares it\n"
            + yaml.safe_dump_all(docs, sort_keys=True))
        written.append(str(path.relative_to(REPO)))
    return written


def by_kind_and_name(docs: list[Doc]) -> dict[tuple[str, str], Doc]:
    keyed = {(doc["kind"], doc["metadata"]["name"]): doc for doc in docs}
    if len(keyed) != len(docs):
        raise KustomizeError("two objects with the same kind and name")
    return keyed


def _apply_patch(docs: list[Doc], patch: Doc, directory: Path) -> None:
    if set(patch) - {"target", "patch", "path"}:
        raise KustomizeError(f"unsupported patch fields {sorted(set(patch))}")
    target = patch.get("target") or {}
    if set(target) - {"kind", "name"} or not target:
        raise KustomizeError(f"patch targets must name kind and/or name: {target}")
    text = patch["patch"] if "patch" in patch else (directory / patch["path"]).read_text()
    ops = yaml.safe_load(text)
    matched = [doc for doc in docs
               if doc["kind"] == target.get("kind", doc["kind"])
               and doc["metadata"]["name"] == target.get("name", doc["metadata"]["name"])]
    if not matched:
        raise KustomizeError(f"patch target {target} matches nothing")
    if isinstance(ops, dict) and ops.get("$patch") == "delete":
        _check_delete(ops, matched)
        for doc in matched:
            docs.remove(doc)
        return
    if not isinstance(ops, list):
        raise KustomizeError("only JSON 6902 patches (a list of operations) and "
                             "`$patch: delete` are supported")
    for doc in matched:
        for op in ops:
            _json6902(doc, op)


def _check_delete(patch: Doc, matched: list[Doc]) -> None:
    """A ``$patch: delete`` patch must name exactly the object it deletes: its apiVersion,
    kind and metadata.name, nothing more (a fuller strategic merge is not supported)."""
    if set(patch) != {"$patch", "apiVersion", "kind", "metadata"} or \
            set(patch["metadata"]) != {"name"}:
        raise KustomizeError(f"a `$patch: delete` patch names apiVersion, kind and "
                             f"metadata.name only: {sorted(patch)}")
    for doc in matched:
        named = (patch["apiVersion"], patch["kind"], patch["metadata"]["name"])
        if (doc["apiVersion"], doc["kind"], doc["metadata"]["name"]) != named:
            raise KustomizeError(f"`$patch: delete` of {named} targets {doc['kind']}/"
                                 f"{doc['metadata']['name']}")


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise KustomizeError(f"bad JSON pointer {path!r}")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def _json6902(doc: Doc, op: Doc) -> None:
    *parents, last = _pointer(op["path"])
    node: Any = doc
    for part in parents:
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, ValueError) as exc:
            raise KustomizeError(f"{op['op']} {op['path']}: no {part!r}") from exc
    kind = op["op"]
    value = copy.deepcopy(op.get("value"))
    key: int | str
    if isinstance(node, list):
        key = len(node) if last == "-" else int(last)
        present = key < len(node)
    else:
        key, present = last, last in node
    if kind == "add":
        if isinstance(node, list):
            node.insert(key, value)  # type: ignore[arg-type]
        else:
            node[key] = value
    elif kind not in ("replace", "remove", "test"):
        raise KustomizeError(f"unsupported op {kind!r}")
    elif not present:
        raise KustomizeError(f"{kind} {op['path']}: no {last!r}")
    elif kind == "replace":
        node[key] = value
    elif kind == "remove":
        del node[key]
    elif node[key] != value:
        raise KustomizeError(f"test {op['path']}: {node[key]!r} != {value!r}")


def _split_image(image: str) -> tuple[str, str]:
    """(name, the tag or digest suffix including its separator)."""
    if "@" in image:
        name, digest = image.split("@", 1)
        return name, "@" + digest
    slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > slash:
        return image[:colon], image[colon:]
    return image, ""


def _set_images(node: Any, image: Doc) -> None:
    if isinstance(node, list):
        for item in node:
            _set_images(item, image)
        return
    if not isinstance(node, dict):
        return
    for key in ("containers", "initContainers"):
        for container in node.get(key) or []:
            name, suffix = _split_image(container.get("image", ""))
            if name != image["name"]:
                continue
            if "digest" in image:
                suffix = "@" + image["digest"]
            elif "newTag" in image:
                suffix = ":" + str(image["newTag"])
            container["image"] = image.get("newName", name) + suffix
    for value in node.values():
        _set_images(value, image)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Keep the real kustomize's output of k8s/ "
                                     "in tests/k8s_rendered (make k8s-rendered).")
    parser.parse_args(argv)
    tool = real_tool()
    if tool is None:
        print("k8s-rendered: neither kubectl nor kustomize is installed: install one "
              "(kubectl >= 1.27 has kustomize v5) and run it again", file=sys.stderr)
        return 2
    for path in write_rendered(tool):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
