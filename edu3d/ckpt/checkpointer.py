"""Saving and resuming a run: the :class:`Checkpointer` that ``edu3d train --ckpt-dir`` drives.

After reading this file you should understand one save and one resume, seen from a rank
(the files themselves are described in :mod:`edu3d.ckpt.format`):

**save(step)**

1. wait for the previous save: at most one is in flight;
2. *snapshot*: copy the pieces this rank owns into fresh CPU tensors. Under
   ``--async-save`` this is all the training step waits for (``ckpt_blocked_s`` in the
   step's record); the parameters may change as soon as it returns;
3. write ``rank-R.pt``, then its receipt ``rank-R.json`` (sha256, size, pieces), each
   through :func:`~edu3d.ckpt.blobs.write_atomic`;
4. rank 0 waits until every rank's receipt for *this* save is on disk (a synchronous save:
   a barrier), then writes ``manifest.json``: from that moment the folder is a checkpoint.
   With ``--keep-last K`` rank 0 then removes all but the newest K
   (:func:`~edu3d.ckpt.format.prune`) and, ``--incremental``, the blobs none of those K
   names (:func:`~edu3d.ckpt.format.collect_blobs`, which reads a kept manifest only if
   this process did not write it or it changed since: never an older step's);
5. (synchronous save) a barrier: no rank goes on to the next step before the checkpoint
   is committed, so a rank that dies in that step is restarted from this one. (Without it,
   a rank could die in the next step while rank 0 was still writing the manifest.)

Every collective here goes through :mod:`edu3d.distributed.comm`, and a synchronous write
is a ``ckpt_write`` span: the flight record shows a rank waiting in the barrier as waiting,
and one stuck writing to a slow disk as ``in ckpt_write``, so the heartbeat
(:mod:`edu3d.launch.heartbeat`) blames the slow disk's rank, never one that waits for it.

Under ``--async-save`` steps 3 and 4 run in a background thread and step 5 is skipped. The
thread uses no collective on purpose: a second thread must never enter the trainer's process
groups (collectives must be issued in the same order on every rank), so rank 0 learns that
the others are done from their receipts. A receipt carries a token the ranks agreed on when
the run started, so a receipt left by an earlier, killed run in the same folder is never
mistaken for this one's.

**resume()**: read the newest manifest (or ``--resume-step N``'s), refuse it if it belongs
to another run (model, seed, global batch, optimizer settings), then fill every piece this
rank now holds (:meth:`~edu3d.train.trainer.Trainer.checkpoint_slots`) from the saved pieces
that overlap it, whatever layout wrote them (:mod:`edu3d.ckpt.reshard`), set the optimizer's
step count and the fp16 loss scale, and return the records the checkpoint kept. Training then
goes on with step ``step + 1``: its learning rate and its batch are functions of the step
alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import threading
import time
import uuid

import torch

from edu3d.ckpt import reshard
from edu3d.ckpt.blobs import BlobStore
from edu3d.ckpt.bounds import MAX_MANIFEST_BYTES
from edu3d.distributed import comm, trace
from edu3d.ckpt.format import (FORMAT, FORMAT_BLOBS, MANIFEST, MUST_MATCH, MUST_MATCH_LATER,
                               CheckpointError, blob_names, check_continues, collect_blobs,
                               file_identity, load_pieces, prune, rank_entry, read_manifest,
                               remove_unreferenced, resume_from, step_dir, write_atomic)
from edu3d.ckpt.untrusted import read_rng


class Checkpointer:
    """Saves ``trainer``'s state into ``run.checkpoint.ckpt_dir`` as ``run`` (``edu3d train``'s
    options: ``--save-every``, ``--keep-last``, ``--async-save``) says, and resumes it;
    ``config`` is the model's :class:`~edu3d.model.gpt.GPTConfig`, recorded in the manifest.
    Every rank of the run creates one (collective)."""

    def __init__(self, trainer, run, config):
        self.trainer, self.run, self.config = trainer, run, config
        self.root = step_dir(run.checkpoint.ckpt_dir, 0).parent
        self.every = run.checkpoint.save_every
        self.keep = run.checkpoint.keep_last
        self.background = run.checkpoint.async_save
        self.store = BlobStore(self.root, trainer.mesh.rank) if run.checkpoint.incremental else None
        self.rank, self.world = trainer.mesh.rank, trainer.mesh.layout.world_size
        self.timeout = float(run.launch.timeout)
        self.token = uuid.uuid4().hex
        if self.world > 1:  # every rank's receipts carry rank 0's token
            self.token = comm.broadcast_object(self.token, src=0)
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.written: tuple | None = None  # (step, t0, t1) of the last write, trace clock
        self.history: list[dict] = []  # per save: "step", "blocked" and "write" (t0, t1) in µs
        self.known: dict = {}  # rank 0, --incremental: step -> (manifest file identity, blobs)

    # ---- saving ---------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return step == self.run.training.steps or bool(self.every and step % self.every == 0)

    def after_step(self, step: int, records: list[dict]) -> None:
        """Save if ``step`` is due; the seconds the step waited go into its record."""
        if self.due(step):
            t0 = time.perf_counter()
            self.save(step, records)
            records[-1]["ckpt_blocked_s"] = time.perf_counter() - t0

    def save(self, step: int, records: list[dict]) -> None:
        """Save the state after ``step`` (collective: every rank calls). On the trace's
        compute lane: ``ckpt_blocked`` (what the training thread waited: the previous save,
        the snapshot, and the writes unless ``--async-save``) and ``ckpt_write`` (the
        writes, ``background: true`` when a thread did them); also kept in ``history``."""
        rec = trace.current()
        t0 = rec.now()
        with rec.context(step=step):
            write = self._save(step, records)
        t1 = rec.now()
        rec.record("compute", "ckpt_blocked", t0, t1, step=step)
        self.history.append({"step": step, "blocked": (t0, t1)})
        if write is not None:
            self.history[-1]["write"] = write

    def _save(self, step: int, records: list[dict]) -> tuple | None:
        """The save; returns a synchronous write's ``(t0, t1)``."""
        self.wait()
        folder = step_dir(self.root, step)
        if folder.is_symlink():  # writing through it would overwrite another folder's files
            raise CheckpointError(f"{folder} is a symbolic link: a checkpoint is written only "
                                  "into its own folder; remove the link")
        folder.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:  # an older run's manifest here would vouch for files we replace
            (folder / MANIFEST).unlink(missing_ok=True)
        if self.world > 1:
            comm.barrier()
        job = self.snapshot(step, records)
        self.written = None
        if self.background:
            self.thread = threading.Thread(target=self._write_logged, args=(job,),
                                           name=f"ckpt-step-{step}", daemon=True)
            self.thread.start()
            return None
        rec = trace.current()
        t0 = rec.now()
        with rec.span("compute", "ckpt_write", step=step, background=False):
            self.write_rank(job)
            if self.world > 1:  # every receipt is on disk: no polling
                comm.barrier()
            if self.rank == 0:
                self.write_manifest(job)
            if self.world > 1:  # rank 0 has written the manifest: a synchronous save is
                comm.barrier()  # committed on every rank when it returns (as DCP's save)
        return t0, rec.now()

    def snapshot(self, step: int, records: list[dict]) -> dict:
        """CPU copies of what this rank owns, and (rank 0) the manifest's contents."""
        pieces, data = [], []
        with torch.no_grad():
            for place, view, owned in self.trainer.checkpoint_slots():
                if owned:
                    pieces.append(place)
                    data.append(view.detach().to("cpu", copy=True))
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state()
        job = {"step": step, "pieces": pieces, "data": data, "rng": rng}
        if self.rank == 0:
            prec = self.trainer.precision
            job["manifest"] = {
                "format": FORMAT_BLOBS if self.store else FORMAT, "step": step,
                "steps": self.run.training.steps,
                "config": dataclasses.asdict(self.config),
                "options": self.options(),
                "layout": self.layout(), "optimizer_step": self.trainer.optimizer_step,
                "precision": {"mode": prec.mode, "scale": prec.scale,
                              "good_steps": prec.good_steps, "skipped": prec.skipped},
                "data_position": f"step {step}: the next batch is corpus.batch({step + 1})",
                "records": json.loads(json.dumps(records[:step])),
            }
        return job

    def options(self) -> dict:
        """The options a continuation must share (``MUST_MATCH``), as plain values: the
        ``--freeze`` globs as the flag wrote them (``"a.*,b.*"``, or null)."""
        flat = self.run.flat()
        out = {k: flat[k] for k in (*MUST_MATCH, *MUST_MATCH_LATER)}
        out["freeze"] = ",".join(self.run.memory.freeze) or None
        return out

    def layout(self) -> dict:
        layout, run = self.trainer.mesh.layout, self.trainer.run
        out = {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp, "vpp": layout.vpp,
               "zero": run.parallel.zero, "schedule": run.parallel.schedule,
               "microbatches": run.microbatches,
               "world_size": layout.world_size}
        if run.parallel.hsdp > 1:  # HSDP: the first replica group wrote the shards
            out["hsdp"] = run.parallel.hsdp
        return out

    def write(self, job: dict) -> None:
        """Write this rank's file and receipt; rank 0 then writes the manifest."""
        t0 = trace.current().now()
        self._write(job)
        self.written = (job["step"], t0, trace.current().now())

    def _trace_write(self) -> None:
        if self.written is not None:  # emitted from the training thread, never the writer's
            step, t0, t1 = self.written
            trace.current().record("compute", "ckpt_write", t0, t1, step=step,
                                   background=self.background)
            self.history[-1]["write"] = (t0, t1)
            self.written = None

    def _write(self, job: dict) -> None:
        self.write_rank(job)
        if self.rank == 0:
            self.write_manifest(job)

    def write_rank(self, job: dict) -> None:
        """This rank's file (``--incremental``: its blobs), then its receipt."""
        folder = step_dir(self.root, job["step"])
        name = f"rank-{self.rank:05d}"
        if self.store is not None:
            refs, written = [], []
            for t in job["data"]:
                ref, new = self.store.put(t)
                refs.append(ref)
                written += [ref["sha256"]] if new else []
            rng = {}
            for k, t in job["rng"].items():
                rng[k], new = self.store.put(t)
                written += [rng[k]["sha256"]] if new else []
            self.store.sync()  # every blob durable before the receipt that names them
            receipt = {"token": self.token, "step": job["step"], "rank": self.rank,
                       "file": name, "pieces": job["pieces"], "blobs": refs, "rng": rng,
                       "written": written}
            write_atomic(folder / f"{name}.json", json.dumps(receipt).encode())
            return
        buf = io.BytesIO()
        torch.save({k: job[k] for k in ("step", "pieces", "data", "rng")}, buf)
        data = buf.getvalue()
        write_atomic(folder / f"{name}.pt", data)
        receipt = {"token": self.token, "step": job["step"], "rank": self.rank,
                   "file": f"{name}.pt", "sha256": hashlib.sha256(data).hexdigest(),
                   "bytes": len(data), "pieces": job["pieces"]}
        write_atomic(folder / f"{name}.json", json.dumps(receipt).encode())

    def write_manifest(self, job: dict) -> None:
        """Once every rank's receipt of this save is on disk: the manifest, last."""
        folder = step_dir(self.root, job["step"])
        deadline = time.monotonic() + self.timeout
        receipts: dict[int, dict] = {}
        while len(receipts) < self.world:
            for r in set(range(self.world)) - set(receipts):
                path = folder / f"rank-{r:05d}.json"
                try:  # a receipt is small: a bigger file is stale, replaced when rank r writes
                    rec = json.loads(path.read_bytes()) if path.stat().st_size <= \
                        MAX_MANIFEST_BYTES else None
                except (OSError, ValueError, RecursionError):
                    continue
                if (isinstance(rec, dict) and rec.get("token") == self.token
                        and rec.get("step") == job["step"]
                        and rec.get("file") == rank_entry(job["manifest"], r)):
                    receipts[r] = rec
            if len(receipts) < self.world:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.world)) - set(receipts))
                    raise CheckpointError(f"{folder}: ranks {missing} wrote no receipt within "
                                          f"{self.timeout:g} s; no manifest written")
                time.sleep(0.005)
        manifest = dict(job["manifest"])
        keys = ("rank", "pieces", "blobs", "rng", "written") if self.store else \
            ("rank", "sha256", "bytes", "pieces")
        manifest["files"] = {rec["file"]: {k: rec[k] for k in keys}
                             for _, rec in sorted(receipts.items())}
        if self.store is not None:
            manifest["incremental"] = reuse(manifest)
        write_atomic(folder / MANIFEST, json.dumps(manifest, indent=1).encode())
        if self.store is not None:  # what this manifest names: never read back
            self.known[job["step"]] = (file_identity(folder / MANIFEST), blob_names(manifest))
        if self.keep:  # committed: now the older checkpoints may go (--keep-last)
            prune(self.root, self.keep, upto=job["step"])
        if self.store is not None and self.keep:  # blobs no kept manifest names
            collect_blobs(self.root, self.known)
        elif self.store is not None:  # nothing was removed: only a killed save's temporaries
            remove_unreferenced(self.root, None)

    def _write_logged(self, job: dict) -> None:
        try:
            self.write(job)
        except BaseException as err:  # re-raised in the training thread by wait()
            self.error = err

    def wait(self) -> None:
        """Wait for a save in flight; raise its error if it failed."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
            self._trace_write()
        if self.error is not None:
            err, self.error = self.error, None
            raise err

    def close(self) -> None:
        self.wait()

    # ---- resuming -------------------------------------------------------------------------------
    def resume(self, step: int | None = None) -> list[dict]:
        """Load the checkpoint of ``step`` (default: ``--resume-step``, else the newest
        complete one, :func:`~edu3d.ckpt.format.resume_from`) into the trainer, whatever
        layout wrote it; returns its records ([] when there is none)."""
        self.wait()
        step = resume_from(self.run) if step is None else step
        if not step:
            return []
        manifest = read_manifest(self.root, step)
        check_continues(manifest, self.config, self.run)
        self.load(manifest)
        return manifest["records"]

    def load(self, manifest: dict) -> None:
        folder = step_dir(self.root, manifest["step"])
        slots = self.trainer.checkpoint_slots()
        saved = load_pieces(folder, manifest, [place for place, _, _ in slots])
        by_key: dict = {}
        for place, view, _ in slots:
            by_key.setdefault((place["name"], place["kind"]), []).append((place, view))
        with torch.no_grad():
            for key, mine in by_key.items():  # one full tensor at a time
                shape = saved[key][0][0]["shape"]
                if shape != mine[0][0]["shape"]:
                    raise CheckpointError(f"{folder / MANIFEST}: {key[0]} ({key[1]}) is saved "
                                          f"with shape {shape}, the model's is "
                                          f"{mine[0][0]['shape']}")
                values, seen = reshard.place_all(saved[key])
                for place, view in mine:
                    if not reshard.read(seen, place).all():
                        raise CheckpointError(f"{folder}: no saved piece covers {key[0]} "
                                              f"({key[1]}) box {place['box']}: a shard is "
                                              "missing")
                    view.copy_(reshard.read(values, place))
        self.trainer.optimizer_step = manifest["optimizer_step"]
        prec, saved_prec = self.trainer.precision, manifest["precision"]
        if prec.mode == saved_prec["mode"]:
            prec.scale, prec.good_steps = saved_prec["scale"], saved_prec["good_steps"]
            prec.skipped = saved_prec["skipped"]
        if manifest["layout"] == self.layout():  # the same ranks: their random states too
            name = rank_entry(manifest, self.rank)
            rng = read_rng(folder, name, manifest["files"][name])
            try:
                torch.set_rng_state(rng["torch"])
                if "cuda" in rng and torch.cuda.is_available():
                    torch.cuda.set_rng_state(rng["cuda"])
            except (TypeError, KeyError, RuntimeError) as err:
                raise CheckpointError(f"{folder / name}: its random state is not one torch "
                                      f"can restore ({err})") from None


def reuse(manifest: dict) -> dict:
    """An incremental save's bytes: ``"bytes"`` the distinct blobs its manifest names,
    ``"written"`` those this save wrote, ``"reused"`` those earlier saves had written."""
    size, written = {}, set()
    for info in manifest["files"].values():
        for ref in [*info["blobs"], *info["rng"].values()]:
            size[ref["sha256"]] = ref["bytes"]
        written.update(info["written"])
    total, new = sum(size.values()), sum(size[s] for s in written if s in size)
    return {"bytes": total, "written": new, "reused": total - new, "blobs": len(size),
            "blobs_written": len(written)}
