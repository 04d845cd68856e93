"""Clusters: a GPU profile and a GPU count, or a shipped cluster profile with its links.

Shipped cluster profiles (``profiles/clusters/*.json``) describe networks beyond one
GPU profile's defaults: several sites joined by slow links, commodity Ethernet, a cloud's
fabric (AWS EFA). A name that is not a cluster profile is a GPU profile (``plan
profiles``), which needs the number of GPUs.
"""

from __future__ import annotations

from pathlib import Path

from planner.errors import SpecError, UnknownNameError
from planner.hardware import list_profiles, profile_dir
from planner.io import read_json
from planner.spec import Cluster, load_document

__all__ = ["list_clusters", "load_cluster", "resolve_cluster"]


def _cluster_dir() -> Path:
    return profile_dir() / "clusters"


def list_clusters() -> list[str]:
    """Names of the cluster profiles shipped in ``profiles/clusters``."""
    return sorted(path.stem for path in _cluster_dir().glob("*.json"))


def load_cluster(name: str) -> Cluster:
    """A shipped cluster profile by name."""
    path = _cluster_dir() / f"{name}.json"
    if not path.is_file():
        raise UnknownNameError("cluster profile", name, list_clusters())
    return load_document(Cluster, path)


def resolve_cluster(
    name_or_path: str, *, num_gpus: int | None = None, gpus_per_node: int = 8
) -> Cluster:
    """A cluster from a Cluster JSON file, a shipped cluster profile, or a GPU profile
    (a name, or a hardware-profile JSON file) with ``num_gpus`` GPUs, ``gpus_per_node``
    to a node."""
    is_file = name_or_path.endswith(".json") or Path(name_or_path).is_file()
    if is_file and not _is_gpu_profile(Path(name_or_path)):
        cluster = _profile_beside(load_document(Cluster, Path(name_or_path)), Path(name_or_path))
        return _fixed(cluster, name_or_path, num_gpus)
    if name_or_path in list_clusters():
        return _fixed(load_cluster(name_or_path), name_or_path, num_gpus)
    if not is_file and name_or_path not in list_profiles():
        raise UnknownNameError("cluster or GPU profile", name_or_path, _names())
    if num_gpus is None:
        raise SpecError(
            f"--cluster {name_or_path} is a GPU profile: give --gpus N, or name a cluster "
            f"profile ({', '.join(list_clusters())}) or a cluster.json"
        )
    fields = {"gpu": name_or_path, "num_gpus": num_gpus, "gpus_per_node": gpus_per_node}
    return load_document(Cluster, fields, "command line")


def _is_gpu_profile(path: Path) -> bool:
    """Whether ``path`` holds a hardware profile (what ``plan calibrate`` writes), not a
    cluster: its peak FLOP rates say so."""
    try:
        document = read_json(path, what="cluster file")
    except SpecError:
        return False  # load_document says what is wrong with it
    return isinstance(document, dict) and "peak_tflops" in document


def _profile_beside(cluster: Cluster, path: Path) -> Cluster:
    """``cluster`` read from ``path``, its ``gpu`` naming a hardware-profile file by a
    relative path read from the cluster file's directory (as a config's own paths are);
    raises naming the field when that file does not exist."""
    if not cluster.gpu.endswith(".json") or Path(cluster.gpu).is_absolute():
        return cluster
    profile = path.parent / cluster.gpu
    if not profile.is_file():
        raise SpecError(
            f"{path}: gpu = {cluster.gpu!r} names a hardware-profile file, but {profile} does "
            f"not exist (a relative path is read from the cluster file's directory, "
            f"{path.parent}): give its path from there or an absolute one, or a GPU profile "
            f"name ({', '.join(list_profiles())})"
        )
    return cluster.model_copy(update={"gpu": str(profile)})


def _fixed(cluster: Cluster, source: str, num_gpus: int | None) -> Cluster:
    """``cluster`` as described, or with ``num_gpus`` where its links are per node (no
    extra tiers): the GPU count of sites joined by shared uplinks goes with those links."""
    if num_gpus is None or num_gpus == cluster.num_gpus:
        return cluster
    if cluster.extra_tiers:
        raise SpecError(
            f"--gpus {num_gpus} with cluster {source!r}, which has num_gpus = "
            f"{cluster.num_gpus} over {len(cluster.extra_tiers)} link tier(s) sized for it: "
            "drop --gpus, or copy the cluster JSON and change its num_gpus and tiers"
        )
    return load_document(
        Cluster, {**cluster.model_dump(), "num_gpus": num_gpus}, f"--gpus {num_gpus}"
    )


def _names() -> list[str]:
    return [*list_clusters(), *list_profiles()]
