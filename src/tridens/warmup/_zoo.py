"""The zoo: trained models (IR description, weights, metric) kept next to a tridens store.

Layout: ``<store>.zoo/<id>.json`` (description, accuracy, provenance, uses) and ``<id>.pt``
(a ``state_dict`` saved with ``torch.save``, loaded with ``weights_only=True``; never a pickled
model), ``clusters.json`` (k-medoids over 1 - score once the zoo passes ``cluster_threshold``).
Entry files are written once (atomically) and read by every process sharing the store, so two
experiments can share one zoo.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch
import torch.nn as nn

from ..errors import StoreError
from ..files import MANIFEST_BYTES, check_archive, regular_file
from . import _match
from ._ir import describe
from ._transform import transfer

__all__ = ["Zoo", "ZooError", "ZooWarning", "Entry", "WarmStart"]

log = logging.getLogger("tridens")


class ZooError(StoreError):
    """The zoo cannot be used (not a tridens store, a model that cannot be described, ...)."""


class ZooWarning(UserWarning):
    """A zoo entry could not be used (weights no longer load, ...); the trial starts cold."""


class Entry:
    __slots__ = ("id", "desc", "accuracy", "meta", "encoded", "nbytes", "uses")

    def __init__(self, id: int, desc: dict[str, Any], accuracy: float, meta: dict[str, Any], nbytes: int, uses: int = 0):
        self.id, self.desc, self.accuracy, self.meta, self.nbytes, self.uses = id, desc, accuracy, meta, nbytes, uses
        self.encoded = _match.encode(desc)

    def __repr__(self) -> str:
        return f"Entry(id={self.id}, accuracy={self.accuracy:.4f}, nodes={self.encoded.n}, {self.meta.get('name') or ''})"


class WarmStart:
    """The result of :meth:`Zoo.warm_start`: ``parent`` (entry or None), ``score``, ``reason``."""

    def __init__(self, parent: Entry | None, score: float = 0.0, reason: str | None = None,
                 stats: dict[str, Any] | None = None):
        self.parent, self.score, self.reason, self.stats = parent, score, reason, stats or {}

    def __bool__(self) -> bool:
        return self.parent is not None

    def as_info(self) -> dict[str, Any]:
        if self.parent is None:
            return {"parent": None, "reason": self.reason}
        trial = self.parent.meta.get("trial")
        return {"parent": trial if trial is not None else f"zoo:{self.parent.id}", "entry": self.parent.id,
                "parent_experiment": self.parent.meta.get("experiment"), "parent_number": self.parent.meta.get("number"),
                "score": round(self.score, 4), "parent_accuracy": self.parent.accuracy,
                "inherited": round(self.stats.get("inherited_elements", 0) / max(self.stats.get("elements", 1), 1), 4)}


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class Zoo:
    """Trained models to warm-start new ones from, kept beside the tridens store at ``path``.

    >>> zoo = td.warmup.Zoo("tridens.db")                               # doctest: +SKIP
    >>> zoo.add(model, torch.zeros(1, 1, 8, 8), accuracy=0.93)          # doctest: +SKIP
    >>> ws = zoo.warm_start(new_model, torch.zeros(1, 1, 8, 8))         # doctest: +SKIP
    >>> ws.parent, ws.score                                             # doctest: +SKIP

    ``bucket``: width of the similarity buckets (the parent is the most accurate model of the best
    bucket); ``min_score``: no warm start below it; ``cluster_threshold``: from this many entries
    on, matching goes through k-medoids clusters (medoids first, then the ``probe`` best clusters);
    ``max_bytes``: eviction cap on the weights kept; ``outlier_iqr``: admission rejects accuracies
    below Q1 - outlier_iqr * IQR (once ``min_for_outliers`` entries exist).

    ``widen``: how the extra units of a wider child layer start (see :func:`transfer`; ``"zero"`` by
    default: measured on digits, Net2Wider replicas stay copies of each other under Adam and a
    warm-started wide model then learned less in its first epoch than with fresh extra units).

    ``wave_growth``: inside ``td.Experiment`` a TrialGroup of new trials is started in waves so that
    later members can start from earlier ones (see :meth:`waves`); ``None`` starts a group at once.
    """

    def __init__(self, path: str | os.PathLike[str], *, bucket: float = 0.1, min_score: float = 0.05,
                 cluster_threshold: int = 200, probe: int = 3, max_bytes: int | None = None,
                 outlier_iqr: float = 1.5, min_for_outliers: int = 8, create: bool = True,
                 wave_growth: float | None = 2.0, widen: str = "zero"):
        from ..store import Store

        self.path = Path(path)
        if self.path.is_dir():
            raise ZooError(f"{self.path} is a directory, not a tridens store (pass the store file, e.g. tridens.db)")
        if not self.path.exists() and not create:
            raise ZooError(f"no tridens store at {self.path}")
        try:
            with Store(self.path):
                pass
        except StoreError as err:
            raise ZooError(f"{self.path} is not a usable tridens store for a zoo: {err}") from err
        except Exception as err:  # sqlite on a random file
            raise ZooError(f"{self.path} is not a tridens store: {type(err).__name__}: {err}") from err
        self.dir = self.path.with_name(self.path.name + ".zoo")
        self.dir.mkdir(exist_ok=True)
        self.bucket, self.min_score, self.cluster_threshold, self.probe = bucket, min_score, cluster_threshold, probe
        self.max_bytes, self.outlier_iqr, self.min_for_outliers = max_bytes, outlier_iqr, min_for_outliers
        if wave_growth is not None and not (isinstance(wave_growth, (int, float)) and wave_growth >= 1):
            raise ValueError(f"The 'wave_growth' parameter of Zoo must be a number >= 1 or None. Got {wave_growth!r} instead.")
        self.wave_growth = wave_growth
        if widen not in ("replicate", "noise", "zero"):
            raise ValueError(f"The 'widen' parameter of Zoo must be 'replicate', 'noise' or 'zero'. Got {widen!r} instead.")
        self.widen = widen
        self.entries: dict[int, Entry] = {}
        self.broken: dict[int, str] = {}
        self._batch: tuple[list[int], _match.Batch] | None = None
        self._clusters: dict[str, Any] | None = None
        self.refresh()

    # -- scheduling -------------------------------------------------------------------------------
    def waves(self, n: int, first: int = 1) -> list[int]:
        """Sizes of the waves in which the engine starts a group of ``n`` new trials.

        ModelKeeper warm-starts each job from the zoo as it arrives. A group whose members are all
        instantiated before any has trained (an evolution's random initial population, a random
        search's batch) would start every member from the zoo as it was before the group: empty, the
        first time. So the engine instantiates and trains a group in waves, each after the previous
        one has finished and entered the zoo: ``first`` trials (the executor's parallelism), then
        waves that grow the group's started total by ``wave_growth`` times (2: 1, 1, 2, 4, 8, ...;
        1: waves of ``first``). The cost: fusion (operator batching, shared data pipelines) and
        lockstep only within a wave, and about log2(n) rounds instead of one.

        >>> Zoo("tridens.db").waves(10)                                     # doctest: +SKIP
        [1, 1, 2, 4, 2]
        """
        first = max(1, int(first))
        if n <= first or self.wave_growth is None:
            return [n] if n > 0 else []
        sizes, done = [first], first
        while done < n:
            size = max(first, math.ceil(done * (self.wave_growth - 1)))
            size = min(size, n - done)
            sizes.append(size)
            done += size
        return sizes

    # -- reading ----------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Pick up entries other processes added (and drop evicted ones)."""
        seen = set()
        for f in self.dir.glob("*.json"):
            if not f.stem.isdigit():
                continue
            eid = int(f.stem)
            seen.add(eid)
            if eid in self.entries:
                continue
            try:  # entry files may come from someone else: regular files of bounded size only
                rec = json.loads(regular_file(f, inside=self.dir, max_bytes=MANIFEST_BYTES, what="zoo entry").read_text())
                self.entries[eid] = Entry(eid, rec["desc"], float(rec["accuracy"]), rec.get("meta", {}),
                                          int(rec.get("bytes", 0)), int(rec.get("uses", 0)))
            except Exception as err:
                self.broken[eid] = f"unreadable entry: {type(err).__name__}: {err}"
        for eid in set(self.entries) - seen:
            del self.entries[eid]
        self._batch = None if self._batch is None or set(self._batch[0]) != set(self.entries) else self._batch

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self):
        return iter(sorted(self.entries.values(), key=lambda e: e.id))

    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def weights(self, entry: Entry | int) -> dict[str, torch.Tensor]:
        """The entry's state_dict; :class:`ZooError` if the file no longer loads."""
        eid = entry.id if isinstance(entry, Entry) else int(entry)
        f = self.dir / f"{eid}.pt"
        try:
            regular_file(f, inside=self.dir, what="zoo weights file")
            check_archive(f, what="zoo weights file")
            state = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as err:
            raise ZooError(f"the weights of zoo entry {eid} ({f}) no longer load: {type(err).__name__}: {err}") from err
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ZooError(f"the weights of zoo entry {eid} ({f}) are not a state_dict")
        return state

    # -- adding -----------------------------------------------------------------------------------
    def add(self, model: nn.Module, example_inputs: Any = None, *, accuracy: float, name: str | None = None,
            **meta: Any) -> Entry | None:
        """Describe ``model`` and keep it with its weights and ``accuracy`` (higher is better).
        Returns the entry, or None when admission rejects it (an accuracy outlier, NaN).

        A model that cannot be matched raises :class:`ZooError` (a :class:`~tridens.TridensError`)
        naming the model and the reason: one torch.fx cannot trace whole (an opaque node: its
        layers could not be aligned with anything), or whose tracing fails outright.
        Inside ``td.Experiment`` such a model is never an error: the trial starts cold and the
        log says why.

        >>> zoo.add(trained_cnn, torch.zeros(1, 1, 28, 28), accuracy=0.91, name="cnn-a")  # doctest: +SKIP
        """
        if not isinstance(model, nn.Module):
            raise ZooError(f"The 'model' parameter of Zoo.add must be an nn.Module. Got {type(model).__name__} instead.")
        label = f"{name!r} ({type(model).__name__})" if name else type(model).__name__
        try:
            desc = describe(model, example_inputs)
            state = model.state_dict()
        except Exception as err:
            raise ZooError(f"The model {label} cannot be added to the zoo: tracing or reading it failed "
                           f"({type(err).__name__}: {err})") from err
        if desc["opaque"]:
            raise ZooError(f"The model {label} cannot be added to the zoo: torch.fx cannot trace it whole, "
                           f"so its layers cannot be matched (opaque node {desc['opaque']})")
        return self.add_description(desc, state, accuracy=accuracy, name=name or type(model).__name__, **meta)

    def add_experiment(self, name: str, store: str | os.PathLike[str] | None = None, *,
                       trust_code: bool = False, allow_modules: Sequence[str] = ()) -> list[Entry]:
        """Add every finished trial (with a checkpoint) of experiment ``name`` of ``store`` (default:
        this zoo's store) that is not in the zoo yet: the experiment's space is rebuilt from its
        stored recipe, frozen with the trial's sample, and described. Trials whose checkpoint no
        longer loads are skipped with a :class:`ZooWarning`. The store may come from someone else:
        its recipe resolves to classes in already imported modules (or ``allow_modules``) only,
        unless ``trust_code=True`` (see :func:`tridens.space.build_space`)."""
        from ..files import model_bytes_limit
        from ..space import check_frozen, checked_space
        from ..store import Store
        from ..trial import TrialStatus

        path = Path(store) if store is not None else self.path
        with Store(path, readonly=True) as db:
            record = db.get_experiment(name)
            trials = db.trials(name)
            if not record.config.get("space"):
                raise ZooError(f"experiment {name!r} has no space recipe in {path}: its trials cannot be rebuilt")
            what = f"the space recipe of experiment {name!r} in {path}"
            space = checked_space(record.config["space"], max_bytes=model_bytes_limit(), what=what,
                                  trust_code=trust_code, allow_modules=allow_modules)
            objective = record.objective()
            have = {(e.meta.get("store"), e.meta.get("trial")) for e in self.entries.values()}
            added = []
            for t in trials:
                if t.status not in (TrialStatus.COMPLETED, TrialStatus.STOPPED) or not t.checkpoint or t.metric is None:
                    continue
                if (str(Path(path).absolute()), t.id) in have:
                    continue
                try:
                    weights = db.load_checkpoint(t.checkpoint)
                    check_frozen(space, t.sample, what=what, weights=weights, weights_file=f"the checkpoint of trial {t.label}")
                    model = space.freeze(space.restrict(t.sample), check=False)
                    model.load_state_dict(weights)
                except Exception as err:
                    warnings.warn(f"trial {t.label} of {name!r} skipped: {type(err).__name__}: {err}", ZooWarning, stacklevel=2)
                    continue
                desc = describe(model, space.example_inputs)
                if desc["opaque"]:
                    log.info("zoo: trial %d of %s not added: opaque node (%s)", t.label, name, desc["opaque"])
                    continue
                entry = self.add_description(desc, model.state_dict(), accuracy=objective.score(t.metric), trial=t.id,
                                             number=t.label, experiment=name, store=str(Path(path).absolute()))
                if entry is not None:
                    added.append(entry)
        return added

    def admits(self, accuracy: float) -> tuple[bool, str | None]:
        if accuracy is None or not math.isfinite(accuracy):
            return False, f"accuracy {accuracy!r} is not a finite number"
        accs = [e.accuracy for e in self.entries.values()]
        if len(accs) >= self.min_for_outliers:
            q1, q3 = np.percentile(accs, [25, 75])
            low = q1 - self.outlier_iqr * max(q3 - q1, 1e-3)
            if accuracy < low:
                return False, f"accuracy {accuracy:.4f} is an outlier (below Q1 - {self.outlier_iqr} IQR = {low:.4f})"
        return True, None

    def add_description(self, desc: dict[str, Any], state: dict[str, torch.Tensor], *, accuracy: float,
                        **meta: Any) -> Entry | None:
        ok, why = self.admits(accuracy)
        if not ok:
            log.info("zoo: not admitted (%s)", why)
            return None
        state = {k: v.detach().cpu().clone() for k, v in state.items()}
        eid = self._next_id()
        wf = self.dir / f"{eid}.pt"
        torch.save(state, wf)
        nbytes = wf.stat().st_size
        meta = {k: v for k, v in meta.items() if v is not None}
        meta["added"] = time.time()
        rec = {"desc": desc, "accuracy": float(accuracy), "meta": meta, "bytes": nbytes, "uses": 0}
        _atomic_write(self.dir / f"{eid}.json", json.dumps(rec).encode())
        entry = Entry(eid, desc, float(accuracy), meta, nbytes)
        self.entries[eid] = entry
        self._batch = None
        self._evict()
        return self.entries.get(eid)

    def _next_id(self) -> int:
        existing = [int(f.stem) for f in self.dir.glob("*.json") if f.stem.isdigit()] + list(self.entries)
        eid = max(existing, default=-1) + 1
        while True:  # claim the id (another process may add at the same time)
            try:
                fd = os.open(self.dir / f"{eid}.pt", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                os.close(fd)
                return eid
            except FileExistsError:
                eid += 1

    def usefulness(self, e: Entry) -> tuple[float, float]:
        """Eviction order (lowest goes first): times chosen as a parent, then accuracy."""
        return (float(e.uses), e.accuracy)

    def _evict(self) -> list[int]:
        gone: list[int] = []
        if self.max_bytes is None:
            return gone
        while self.entries and self.nbytes() > self.max_bytes:
            victim = min(self.entries.values(), key=self.usefulness)
            self.remove(victim.id)
            gone.append(victim.id)
        if gone:
            log.info("zoo: evicted %s to stay under %d bytes", gone, self.max_bytes)
        return gone

    def remove(self, eid: int) -> None:
        for suffix in (".json", ".pt"):
            try:
                (self.dir / f"{eid}{suffix}").unlink()
            except FileNotFoundError:
                pass
        self.entries.pop(eid, None)
        self._batch = None

    def _bump_uses(self, e: Entry) -> None:
        e.uses += 1
        f = self.dir / f"{e.id}.json"
        try:
            rec = json.loads(regular_file(f, inside=self.dir, max_bytes=MANIFEST_BYTES, what="zoo entry").read_text())
            rec["uses"] = e.uses
            _atomic_write(f, json.dumps(rec).encode())
        except Exception:  # a use count is advisory
            pass

    # -- matching ---------------------------------------------------------------------------------
    def _all_batch(self) -> tuple[list[int], _match.Batch]:
        if self._batch is None:
            ids = sorted(i for i in self.entries if i not in self.broken)
            self._batch = (ids, _match.Batch([self.entries[i].encoded for i in ids]))
        return self._batch

    def scores(self, desc: dict[str, Any], ids: Iterable[int] | None = None) -> dict[int, float]:
        """Alignment score of a description against the given entries (default: all)."""
        child = _match.encode(desc)
        if ids is None:
            ids, batch = self._all_batch()
        else:
            ids = [i for i in ids if i in self.entries]
            batch = _match.Batch([self.entries[i].encoded for i in ids])
        if not ids:
            return {}
        return dict(zip(ids, _match.scores(child, batch).tolist()))

    def candidates(self, desc: dict[str, Any]) -> dict[int, float]:
        """Scores of the entries worth considering: all of them in a small zoo; in a large one the
        medoids first, then the members of the ``probe`` best clusters (and unclustered entries)."""
        live = [i for i in self.entries if i not in self.broken]
        if len(live) < self.cluster_threshold:
            return self.scores(desc)
        clusters = self.clusters()
        medoids = [m for m in clusters["medoids"] if m in self.entries]
        med = self.scores(desc, medoids)
        best = sorted(med, key=lambda m: -med[m])[:self.probe]
        members = [i for i in live if clusters["assign"].get(str(i)) in best or str(i) not in clusters["assign"]]
        out = self.scores(desc, [i for i in members if i not in med])
        out.update(med)
        return out

    def choose(self, scored: dict[int, float]) -> tuple[Entry, float] | None:
        """Bucket by score (width ``bucket``), take the best bucket, the most accurate model in it."""
        ok = {i: s for i, s in scored.items() if s >= self.min_score and i not in self.broken}
        if not ok:
            return None
        top = max(math.floor(s / self.bucket + 1e-9) for s in ok.values())
        bucket = [i for i, s in ok.items() if math.floor(s / self.bucket + 1e-9) == top]
        eid = max(bucket, key=lambda i: (self.entries[i].accuracy, ok[i], -i))
        return self.entries[eid], ok[eid]

    def match(self, model: nn.Module | dict[str, Any], example_inputs: Any = None) -> tuple[Entry, float] | None:
        """The best parent for ``model`` (or a description) and its score, or None."""
        desc = model if isinstance(model, dict) else describe(model, example_inputs)
        return self.choose(self.candidates(desc))

    def warm_start(self, model: nn.Module, example_inputs: Any = None, *, desc: dict[str, Any] | None = None,
                   exclude: Iterable[int] = ()) -> WarmStart:
        """Find the best parent and load its transformed weights into ``model`` (in place).
        Never raises for a bad entry or an untraceable model: the result says why nothing was done."""
        self.refresh()
        try:
            desc = desc if desc is not None else describe(model, example_inputs)
        except Exception as err:
            return WarmStart(None, reason=f"the model cannot be traced: {type(err).__name__}: {err}")
        if desc["opaque"]:
            return WarmStart(None, reason=f"the model has an opaque node ({desc['opaque']})")
        if not self.entries:
            return WarmStart(None, reason="the zoo is empty")
        scored = self.candidates(desc)
        for i in exclude:
            scored.pop(i, None)
        while True:
            choice = self.choose(scored)
            if choice is None:
                return WarmStart(None, reason=f"no zoo model scores at least {self.min_score} "
                                              f"(best {max(scored.values(), default=0.0):.3f})")
            entry, s = choice
            try:
                parent_state = self.weights(entry)
                _, pairs = _match.align(desc, entry.desc)
                child_state = model.state_dict()
                new, stats = transfer(desc, entry.desc, pairs, parent_state, child_state, widen=self.widen)
                model.load_state_dict(new)
            except Exception as err:
                msg = f"zoo entry {entry.id} skipped: {err}" if isinstance(err, ZooError) else \
                      f"zoo entry {entry.id} skipped: its weights do not transfer ({type(err).__name__}: {err})"
                warnings.warn(msg, ZooWarning, stacklevel=2)
                log.warning("%s", msg)
                self.broken[entry.id] = msg
                self._batch = None
                scored.pop(entry.id, None)
                continue
            self._bump_uses(entry)
            return WarmStart(entry, s, stats=stats)

    # -- clustering -------------------------------------------------------------------------------
    def clusters(self, force: bool = False) -> dict[str, Any]:
        """k-medoids over 1 - score (k = ceil(sqrt(n))), cached in ``clusters.json`` and recomputed
        when the zoo has grown by a quarter since."""
        f = self.dir / "clusters.json"
        live = sorted(i for i in self.entries if i not in self.broken)
        if self._clusters is None and f.exists() and not force:
            try:
                self._clusters = json.loads(regular_file(f, inside=self.dir, max_bytes=MANIFEST_BYTES,
                                                         what="zoo clusters file").read_text())
            except Exception:
                self._clusters = None
        c = self._clusters
        if force or c is None or len(live) > 1.25 * c.get("n", 0) or not any(m in self.entries for m in c["medoids"]):
            c = self._kmedoids(live)
            _atomic_write(f, json.dumps(c).encode())
            self._clusters = c
        return c

    def _kmedoids(self, ids: list[int], k: int | None = None, sample: int = 160, iters: int = 8,
                  seed: int = 0) -> dict[str, Any]:
        rng = random.Random(seed)
        k = k or max(1, math.ceil(math.sqrt(len(ids))))
        pool = ids if len(ids) <= sample else rng.sample(ids, sample)
        # distances inside the sample: d(a, b) = 1 - (s(a|b) + s(b|a)) / 2
        batch = _match.Batch([self.entries[i].encoded for i in pool])
        S = np.stack([_match.scores(self.entries[i].encoded, batch) for i in pool])
        D = 1.0 - (S + S.T) / 2
        k = min(k, len(pool))
        # k-medoids++ seeding, then alternate (assign, best medoid per cluster)
        med = [rng.randrange(len(pool))]
        while len(med) < k:
            d = D[:, med].min(axis=1)
            if d.sum() <= 0:
                break
            med.append(int(rng.choices(range(len(pool)), weights=d.tolist())[0]))
            med = list(dict.fromkeys(med))
        for _ in range(iters):
            lab = D[:, med].argmin(axis=1)
            new = []
            for c in range(len(med)):
                members = np.flatnonzero(lab == c)
                if len(members) == 0:
                    new.append(med[c])
                    continue
                new.append(int(members[D[np.ix_(members, members)].sum(axis=1).argmin()]))
            if new == med:
                break
            med = new
        medoids = [pool[m] for m in med]
        # every entry to its nearest medoid (the medoid as the child, one batched call per medoid)
        all_batch = _match.Batch([self.entries[i].encoded for i in ids])
        sim = np.stack([_match.scores(self.entries[m].encoded, all_batch) for m in medoids])  # (k, N)
        lab = sim.argmax(axis=0)
        assign = {str(i): medoids[int(l)] for i, l in zip(ids, lab)}
        return {"n": len(ids), "medoids": medoids, "assign": assign}
