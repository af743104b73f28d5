"""One speculative step as CUDA graphs: verify every draft node, accept on the device, commit
(now or deferred), and draft the next step with a device-resident drafter."""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import TYPE_CHECKING, Callable

import torch

from specla.graphs.runtime import PackedTarget, PhaseClock, StaticState, capture
from specla.model import InferenceState, Topology
from specla.tree import DraftTree

if TYPE_CHECKING:
    from specla.graphs.oracle import DeviceOracle


class SpecTopology:
    """A draft tree's shape as static device tensors: everything verification, acceptance,
    commit and the device oracle need, so none of them asks the host during a replay.

    `load(tree)` rewrites them in place for another tree of the same node count: a graph
    captured with "tree" verification (whose kernels read the parents from the device) then
    serves every tree of that size (`pad_tree` fills smaller ones with dummy nodes).
    """

    def __init__(self, tree: DraftTree, conv_size: int, max_path: int, device):
        self.conv_size, self.max_path, self.n = conv_size, max_path, len(tree)
        host = self._host(tree)
        self.model_topo = Topology(tree, host.pop("parents_raw").to(device),
                                   host.pop("conv_index").to(device))
        self.conv_index = self.model_topo.conv_index
        for name, value in host.items():
            setattr(self, name, value.to(device))
        self.tree = tree
        self.arange_p = torch.arange(max_path, device=device)

    def _host(self, tree: DraftTree) -> dict[str, torch.Tensor]:
        n, P = len(tree), self.max_path
        if n != self.n:
            raise ValueError(f"a topology of {self.n} nodes cannot hold a tree of {n}")
        if tree.depth + 1 > P:
            raise ValueError(f"tree depth {tree.depth} needs paths of {tree.depth + 1} > {P}")
        anc = tree.ancestor_mask()
        earlier = torch.zeros(n, n)
        for kids in tree.children:
            for r, i in enumerate(kids):
                earlier[i, kids[:r]] = 1.0
        path = torch.zeros(n, P, dtype=torch.long)
        for i in range(n):
            nodes = tree.path_to(i)
            path[i, :len(nodes)] = torch.tensor(nodes)
        # the "main line": root, then each main node's first child (the device oracle puts the
        # true continuation only there; for a chain every node is on it)
        main = [True] + [False] * (n - 1)
        for i in range(1, n):
            p = tree.parents[i]
            main[i] = main[p] and tree.children[p][0] == i
        return {"parents_raw": torch.tensor(tree.parents),
                "conv_index": tree.conv_window_index(self.conv_size),
                "parent": torch.tensor([max(p, 0) for p in tree.parents]),
                "anc": anc.float(),
                "anc_or_self": (anc | torch.eye(n, dtype=torch.bool)).float(),
                "earlier_sibling": earlier,
                "is_root": torch.arange(n) == 0,
                "depth": torch.tensor(tree.depths),
                "path_table": path,
                "main": torch.tensor(main)}

    def load(self, tree: DraftTree) -> None:
        """Rewrite every tensor in place for `tree` (same node count; no reallocation)."""
        host = self._host(tree)
        self.model_topo.parents.copy_(host.pop("parents_raw"))
        self.conv_index.copy_(host.pop("conv_index"))
        for name, value in host.items():
            getattr(self, name).copy_(value)
        self.tree = self.model_topo.tree = tree

    @torch.no_grad()
    def rebuild(self, parents: torch.Tensor) -> None:
        """Rewrite every tensor in place from a parents tensor [N] already on the device
        (topological order, -1 for the root), with tensor ops only: a device drafter that
        grows a different tree each step calls this inside the step graph. `self.tree` keeps
        the shape the graph was captured with; `main` (the oracle's line) is not rebuilt."""
        n, P, dev = self.n, self.max_path, parents.device
        par = parents.clamp(min=0)
        nodes = torch.arange(n, device=dev)
        anc = torch.zeros(n, n, device=dev)
        hop = par
        for _ in range(P - 1):                  # climb one level a time; the root stays put
            anc.scatter_(1, hop[:, None], 1.0)
            hop = par.index_select(0, hop)
        anc[0].zero_()
        depth = anc.sum(1).long()
        anc_or_self = anc + torch.eye(n, device=dev)
        at_depth = (depth[:, None] == self.arange_p[None, :]).float()             # [N, P]
        path = ((anc_or_self * nodes[None, :].float()) @ at_depth).long()         # ancestor at each depth
        W = self.conv_size
        seq = depth[:, None] + torch.arange(W, device=dev)[None, :]               # window positions
        from_path = path.gather(1, (seq - (W - 1)).clamp(0, P - 1))
        self.model_topo.parents.copy_(parents)
        self.conv_index.copy_(torch.where(seq < W - 1, seq, W - 1 + from_path))
        self.parent.copy_(par)
        self.anc.copy_(anc)
        self.anc_or_self.copy_(anc_or_self)
        same = (par[:, None] == par[None, :]) & (nodes[None, :] < nodes[:, None])
        real = nodes > 0
        self.earlier_sibling.copy_((same & real[:, None] & real[None, :]).float())
        self.depth.copy_(depth)
        self.path_table.copy_(path)


class StepLog:
    """What each step did, written on the device and read back by the host in batches.

    Row s is step s: the verified tree (tokens root first, -1 for dummy nodes; parents), the
    target's argmax at every node and its probability of each node's token given the node's
    parent, the drafter's log-prob of each node (0 where unknown), and the acceptance
    (accepted drafts a, end node, bonus token, the accepted path padded to P).
    """

    def __init__(self, steps: int, nodes: int, max_path: int, device):
        self.steps, self.nodes = steps, nodes
        i64 = dict(device=device, dtype=torch.long)
        self.tokens = torch.full((steps, nodes), -1, **i64)
        self.parents = torch.zeros(steps, nodes, **i64)
        self.choice = torch.zeros(steps, nodes, **i64)
        self.target_prob = torch.zeros(steps, nodes, device=device)
        self.draft_logp = torch.zeros(steps, nodes, device=device)
        self.result = torch.zeros(steps, 3 + max_path, **i64)

    def buffers(self) -> list[torch.Tensor]:
        return [self.tokens, self.parents, self.choice, self.target_prob, self.draft_logp, self.result]

    def row(self, step: torch.Tensor) -> torch.Tensor:
        """The row index of a device step counter (the last row absorbs any overflow)."""
        return step.clamp(max=self.steps - 1)

    def named(self) -> dict[str, torch.Tensor]:
        """The fields by name, as `LoggedSteps` names them."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(LoggedSteps)}

    def read(self, start: int, stop: int) -> "LoggedSteps":
        """Rows start..stop-1 as host lists (one copy per field)."""
        stop = min(stop, self.steps)
        return LoggedSteps(**{name: buf[start:stop].tolist() for name, buf in self.named().items()})


@dataclasses.dataclass
class LoggedSteps:
    """Host copies of `StepLog` rows (lists indexed [step][node])."""
    tokens: list[list[int]]
    parents: list[list[int]]
    choice: list[list[int]]
    target_prob: list[list[float]]
    draft_logp: list[list[float]]
    result: list[list[int]]             # a, end, bonus, path...


@dataclasses.dataclass
class StepOutcome:
    """One step's acceptance, named (the device packs it as [a, end, bonus, path...])."""
    accepted: int                       # drafted tokens accepted (the root not counted)
    end: int                            # the last accepted node
    bonus: int                          # the token the target adds (the next root)
    path: list[int]                     # accepted nodes, root first

    @classmethod
    def unpack(cls, row: list[int]) -> "StepOutcome":
        a, end, bonus = row[0], row[1], row[2]
        return cls(a, end, bonus, row[3:3 + a + 1])


class SpecState:
    """The static decoding state that speculative graphs share: recurrent + conv state, the
    deferred commit's pending factors padded to `max_path`, and the device-side bookkeeping
    (next root, tokens produced, step count, output tokens, per-step records)."""

    def __init__(self, rt: PackedTarget, max_path: int, capacity: int, max_nodes: int | None = None):
        c, dev, L = rt.config, rt.device, rt.config.num_hidden_layers
        self.rt, self.max_path, self.capacity = rt, max_path, capacity
        self.log = StepLog(capacity + 1, max_nodes or max_path, max_path, dev)
        self.cache = StaticState(c, dev, rt.dtype)
        z = dict(device=dev, dtype=torch.float32)
        self.pk = torch.zeros(L, 1, max_path, c.num_heads, c.head_dim, **z)
        self.pd = torch.zeros(L, 1, max_path, c.num_heads, c.head_v_dim, **z)
        self.pg = torch.zeros(L, 1, max_path, c.num_heads, **z)
        i64 = dict(device=dev, dtype=torch.long)
        self.root, self.pos, self.step = (torch.zeros(1, **i64) for _ in range(3))
        self.out = torch.zeros(capacity + 2 * max_path + 2, **i64)
        self.acc = torch.zeros(capacity + 1, **i64)           # accepted drafts per step
        self.div = torch.zeros(capacity + 1, **i64)           # 1 where bonus != oracle's token
        self.gap = torch.zeros(capacity + 1, **z)             # logit gap at that bonus
        self.last = torch.zeros(5, **i64)                     # a, end node, bonus, diverged, pos

    def buffers(self) -> list[torch.Tensor]:
        return [self.cache.recurrent, self.cache.conv, self.pk, self.pd, self.pg, self.root,
                self.pos, self.step, self.out, self.acc, self.div, self.gap, self.last] + self.log.buffers()

    @torch.no_grad()
    def reset(self, state: StaticState | InferenceState, root: int) -> None:
        self.cache.copy_(state)
        for t in (self.pk, self.pd, self.pg, self.pos, self.step, self.acc, self.div, self.gap):
            t.zero_()
        self.root.fill_(root)

    @contextlib.contextmanager
    def preserved(self):
        """Restore every buffer afterwards (a capture's warm-up runs the step for real)."""
        saved = [t.clone() for t in self.buffers()]
        try:
            yield
        finally:
            for t, s in zip(self.buffers(), saved):
                t.copy_(s)

    @torch.no_grad()
    def flush(self) -> None:
        """Fold the pending commit into the state now (end of decoding, or before AR)."""
        from specla.verify import commit_layer

        for l in range(self.pk.shape[0]):
            commit_layer(self.cache.recurrent[l], self.pk[l], self.pd[l], self.pg[l])
        self.pk.zero_(), self.pd.zero_(), self.pg.zero_()

    @torch.no_grad()
    def folded_copy(self) -> StaticState:
        """A copy of the state with the pending commit folded in (the live state untouched)."""
        from specla.verify import commit_layer

        copy = self.cache.clone()
        for l in range(self.pk.shape[0]):
            commit_layer(copy.recurrent[l], self.pk[l], self.pd[l], self.pg[l])
        return copy

    def output(self) -> list[int]:
        return self.out[:int(self.pos.item())].tolist()


def greedy_accept(topo: SpecTopology, tokens: torch.Tensor, logits: torch.Tensor):
    """`specla.accept.accept_greedy`'s walk as tensor ops: no host sync, no data-dependent shape.

    tokens [N] (-1 = dummy), logits [N, V]. Returns a [1] accepted drafts, end [1] the last
    accepted node, path [P] its root-to-node path (padded), valid [P] path mask, bonus [1].
    """
    choice = logits.argmax(-1)                                                  # [N]
    match = (tokens == choice.index_select(0, topo.parent)) | topo.is_root
    # the walk takes the first matching child; a later duplicate sibling never counts
    first = match & ((topo.earlier_sibling @ match.float()) == 0)
    good = (topo.anc_or_self @ (~first).float()) == 0                           # on the walk
    end = (good.float() * (topo.depth + 1).float()).argmax().view(1)            # its deepest node
    a = topo.depth.index_select(0, end)
    path = topo.path_table.index_select(0, end)[0]
    return a, end, path, topo.arange_p <= a, choice.index_select(0, end)


def torch_tree_verify(q, k, v, g, beta, S0, topo: SpecTopology, pending=None):
    """Graph-safe torch fallback of the verifier (the tree-masked UT form of
    `kernels.reference.tree_verify_ref` with the masks precomputed on the device)."""
    if pending is not None:
        pk, pd, pg = pending
        for t in range(pk.shape[1]):                      # serial, as commit_ref folds
            S0.mul_(pg[:, t].exp()[..., None, None])
            S0.add_(pk[:, t][..., :, None] * pd[:, t][..., None, :])
    anc, anc_or_self = topo.anc.bool(), topo.anc_or_self.bool()
    G = torch.einsum("ij,bjh->bhi", topo.anc_or_self, g.float())          # [B,H,N] path decay
    diff = G[..., :, None] - G[..., None, :]
    decay = torch.where(anc_or_self, diff, torch.full_like(diff, float("-inf"))).exp()
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    bh = beta.transpose(1, 2)[..., None]
    A = bh * decay * (kh @ kh.transpose(-1, -2)) * anc
    rhs = bh * (vh - G.exp()[..., None] * (kh @ S0))
    eye = torch.eye(q.shape[1], dtype=A.dtype, device=A.device)
    u = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    o = G.exp()[..., None] * (qh @ S0) + (decay * (qh @ kh.transpose(-1, -2))) @ u
    return o.transpose(1, 2), u.transpose(1, 2)


PHASES = ("verify", "accept", "draft")


class GraphedSpec:
    """One speculative step for one draft topology, captured as CUDA graphs.

    Phases, each its own graph so that CUDA events between replays time them: `verify` (the
    tree forward; folds the pending commit), `accept` (acceptance, commit or defer, conv
    window, bookkeeping, the step log), `draft` (the device oracle, or a device-resident
    `drafter` such as `specla.graphs.drafters.DeviceDrafter`, if any). With
    `whole_step=True` the three are also captured as one graph (`step`).

    Acceptance is greedy on the device, or, with `host_accept=True`, read from `result`
    where the host wrote it (lossless rejection sampling runs on the host between `verify`
    and `accept`). A chain or tree verified in one persistent launch also accepts greedily in
    that launch (deferred commit; `fused_accept=False`, or `whole_step.FUSED_ACCEPT = False`,
    keeps the torch ops), and `accept` is empty.

    A `drafter` is any object with `draft(spec)`, which reads this step's `result` and
    `features` and writes the next step's `tokens[0, 1:]` with tensor ops only; its static
    buffers (`buffers()`, if it has that method) are restored after each capture's warm-up.
    """

    @torch.no_grad()
    def __init__(self, rt: PackedTarget, state: SpecState, tree: DraftTree, mode: str = "auto",
                 deferred: bool = True, oracle: DeviceOracle | None = None,
                 feature_layers: tuple[int, ...] = (), use_graph: bool | None = None,
                 recurrence: str = "kernels", dynamic: bool = False, drafter=None,
                 host_accept: bool = False, whole_step: bool = False,
                 sampling: tuple[float, float] | None = None, compile: bool = False,
                 persistent_verify: bool = True, fused_accept: bool | None = None):
        from specla.verify import resolve_mode

        if oracle is not None and drafter is not None:
            raise ValueError("a speculative step drafts with the device oracle or a device drafter, not both")
        self.rt, self.state, self.oracle, self.drafter = rt, state, oracle, drafter
        self.deferred, self.feature_layers, self.recurrence = deferred, tuple(feature_layers), recurrence
        self.host_accept = host_accept
        self.sampling = sampling                    # (temperature, top-p): rejection sampling here
        self.topo = SpecTopology(tree, rt.config.conv_size, state.max_path, rt.device)
        self.mode = resolve_mode(mode, self.topo.model_topo, rt.device.type)
        # A graph that serves every tree of its size must not bake in a host-built schedule:
        # only the tree kernels read the topology from the device.
        self.dynamic = dynamic and not tree.is_chain
        if self.dynamic:
            self.mode = "tree"
        n, dev, c = len(tree), rt.device, rt.config
        # verified by the kernels: one persistent launch where the target's AR token is one (a tree's
        # topology is read on the device at every call, so a dynamic tree's rebuild reaches it)
        self.chain_verify, self.verify_note = None, f"per-op {self.mode} verification"
        if persistent_verify and recurrence == "kernels":
            self.chain_verify, why = rt.chain_verifier(n, self.feature_layers, deferred)
            if self.chain_verify is None:
                self.verify_note += f" ({why})"
            else:
                self.verify_note = f"{'a chain' if tree.is_chain else 'a tree'}'s {why}"
        # greedy acceptance in the same launch (its commit deferred), unless the host or sampling accepts
        if fused_accept is None:
            from specla.graphs.whole_step import FUSED_ACCEPT as fused_accept
        self.kernel_accept = (fused_accept and self.chain_verify is not None and sampling is None
                              and not host_accept and deferred)
        if self.kernel_accept:
            self.verify_note += ", then greedy acceptance in the same launch"
        if n > state.log.nodes:
            raise ValueError(f"a draft of {n} nodes does not fit the step log ({state.log.nodes} nodes)")
        self.tokens = torch.tensor([tree.tokens], dtype=torch.long, device=dev)
        self.factors = rt.new_factors(n)
        self.logits = torch.zeros(n, c.vocab_size, device=dev)
        self.last_hidden = torch.zeros(n, c.hidden_size, device=dev, dtype=rt.dtype)
        self.features = (torch.zeros(n, len(self.feature_layers), c.hidden_size, device=dev, dtype=rt.dtype)
                         if self.feature_layers else None)
        self.result = torch.zeros(3 + state.max_path, dtype=torch.long, device=dev)  # a, end, bonus, path
        # the distributions a sampled chain's tokens were drawn from (a device drafter writes them)
        self.proposal = (torch.zeros(n, c.vocab_size, device=dev)
                         if sampling is not None and getattr(drafter, "samples_chains", False) else None)
        self._log_pad = torch.full((state.log.nodes - n,), -1, dtype=torch.long, device=dev)
        self.chain_accept = self._chain_accept(oracle) if self.kernel_accept else None
        self.use_graph = dev.type == "cuda" if use_graph is None else use_graph
        # Greedy acceptance, the step log, the deferred commit and the bookkeeping are ~70 small
        # ops (0.17 ms in a graph on the H200): torch.compile fuses them, as it does the
        # drafter's. Index and compare ops only on the path that decides tokens: exact.
        self.compiled = compile and sampling is None and not host_accept and deferred and not self.kernel_accept
        self._accept = torch.compile(self.accept, dynamic=False) if self.compiled else self.accept
        self.graphs: dict[str, torch.cuda.CUDAGraph] = {}
        self.capture_ms = 0.0
        self.compile_error: str | None = None
        if self.use_graph:
            drafts = oracle is not None or drafter is not None
            for phase in PHASES if drafts else PHASES[:2]:
                if not (phase == "accept" and self.kernel_accept):    # nothing left to capture
                    self._capture(phase)
            if whole_step:
                self._capture("step")

    def _chain_accept(self, oracle: DeviceOracle | None):
        """The buffers the verification's launch accepts into (`kernels/triton_chain_accept.py`)."""
        from kernels.triton_chain_accept import ChainAccept

        st, n, dev = self.state, self.topo.n, self.rt.device
        log = st.log
        return ChainAccept(choice=torch.zeros(n, dtype=torch.long, device=dev), prob=torch.zeros(n, device=dev),
                           pos=st.pos, step=st.step, out=st.out, acc=st.acc,
                           last=st.last, result=self.result, log_tokens=log.tokens, log_parents=log.parents,
                           log_choice=log.choice, log_prob=log.target_prob, log_result=log.result,
                           oracle=(oracle.cont, st.div, st.gap) if oracle is not None else None)

    def _capture(self, phase: str) -> None:
        """Capture one phase; a compiled acceptance that fails to compile or capture falls
        back to the plain ops (the same results, more launches), noted in `compile_error`."""
        try:
            self._capture_once(phase)
        except Exception as err:  # noqa: BLE001 - any compiler failure: run uncompiled
            if not (self.compiled and phase in ("accept", "step")):
                raise
            self.compiled, self._accept = False, self.accept
            self.compile_error = f"{type(err).__name__}: {str(err)[:300]}"
            self._capture_once(phase)

    # ---- phases
    def _verify_layer(self, l, q, k, v, g, beta, S, out=None):
        from specla.verify import verify_layer

        st = self.state
        pending = (st.pk[l], st.pd[l], st.pg[l]) if self.deferred else None
        if self.recurrence == "torch":
            return torch_tree_verify(q, k, v, g, beta, S, self.topo, pending)
        return verify_layer(self.mode, q, k, v, g, beta, S, self.topo.model_topo, pending=pending, out=out)

    def verify(self) -> None:
        st = self.state
        if self.chain_verify is not None:
            f = self.factors
            topo = None if self.topo.tree.is_chain else (self.topo.model_topo.parents, self.topo.conv_index)
            self.chain_verify(self.tokens, st.root, st.cache.conv, st.cache.recurrent,
                              (st.pk, st.pd, st.pg) if self.deferred else None, self.logits, self.last_hidden,
                              self.features, (f.k, f.g, f.delta, f.conv_in), self.chain_accept, topo)
            return
        self.tokens[0, :1].copy_(self.state.root)
        logits, hidden, feats = self.rt.tree_forward(self.tokens, self.state.cache, self.topo.conv_index,
                                                     self._verify_layer, self.factors, self.feature_layers)
        self.logits.copy_(logits)
        self.last_hidden.copy_(hidden)
        if feats is not None:
            self.features.copy_(feats)

    def accept(self) -> None:
        """Acceptance (greedy on the device, or the host's from `result`), then the commit
        (now or deferred), the conv window, the bookkeeping and the step log; nothing where
        the verification's launch already accepted."""
        if self.kernel_accept:
            return
        tok = self.tokens[0]
        probs = None
        if self.host_accept:
            a, end, bonus = self.result[0:1], self.result[1:2], self.result[2:3]
            path = self.result[3:]
            valid = self.topo.arange_p <= a
        elif self.sampling is not None:
            from specla.graphs.sampling import sample_accept, target_probs
            probs = target_probs(self.logits, *self.sampling)
            a, end, path, valid, bonus = sample_accept(self.topo, tok, probs, max(1, self.drafter.top_k),
                                                       self.proposal)
        else:
            a, end, path, valid, bonus = greedy_accept(self.topo, tok, self.logits)
        self._log(tok, probs)
        self._commit(path, valid)
        self._conv_window(path, a)
        self._bookkeep(tok, path, a, bonus, end)

    def _log(self, tok, probs: torch.Tensor | None = None) -> None:
        """The verified tree and the target's view of every node, into the step log's row:
        its probability of each node's token at the node's parent (at temperature 1, or the
        sampling distribution `probs`)."""
        st, topo = self.state, self.topo
        row = st.log.row(st.step)
        logits = self.logits
        if probs is None:
            lse = torch.logsumexp(logits, dim=-1)                                     # [N]
            at_parent = logits.index_select(0, topo.parent).gather(1, tok.clamp(min=0)[:, None])[:, 0]
            prob = (at_parent - lse.index_select(0, topo.parent)).exp()
        else:
            prob = probs.index_select(0, topo.parent).gather(1, tok.clamp(min=0)[:, None])[:, 0]
        prob = torch.where(topo.is_root, 1.0, prob)
        prob = torch.where(tok < 0, 0.0, prob)
        choice = logits.argmax(-1)
        log = st.log
        log.tokens.index_copy_(0, row, torch.cat([tok, self._log_pad])[None])
        log.parents.index_copy_(0, row, torch.cat([topo.parent, self._log_pad.clamp(min=0)])[None])
        log.choice.index_copy_(0, row, torch.cat([choice, self._log_pad.clamp(min=0)])[None])
        log.target_prob.index_copy_(0, row, torch.cat([prob, self._log_pad.float().clamp(min=0)])[None])

    def _commit(self, path, valid) -> None:
        st, f = self.state, self.factors
        k = torch.where(valid[None, None, :, None, None], f.k.index_select(2, path), 0.0)
        d = torch.where(valid[None, None, :, None, None], f.delta.index_select(2, path), 0.0)
        g = torch.where(valid[None, None, :, None], f.g.index_select(2, path), 0.0)
        if self.deferred:
            st.pk.copy_(k), st.pd.copy_(d), st.pg.copy_(g)
            return
        from specla.verify import commit_layer

        for l in range(k.shape[0]):
            commit_layer(st.cache.recurrent[l], k[l], d[l], g[l])

    def _conv_window(self, path, a) -> None:
        """New window = the last W-1 of [old window, conv inputs along the accepted path]."""
        conv = self.state.cache.conv                                      # [L,1,C,W]
        hist = conv.shape[-1] - 1
        src = torch.cat([conv[..., 1:].transpose(-1, -2), self.factors.conv_in], dim=2)
        j = a + 1 + torch.arange(hist, device=a.device)                   # seq positions
        node = path.index_select(0, (j - hist).clamp(0, path.numel() - 1))
        idx = torch.where(j < hist, j, hist + node)
        conv[..., 1:].copy_(src.index_select(2, idx).transpose(-1, -2))

    def _bookkeep(self, tok, path, a, bonus, end) -> None:
        st, P = self.state, self.state.max_path
        d = self.topo.arange_p
        drafted = tok.index_select(0, path.index_select(0, (d + 1).clamp(max=P - 1)))
        new = torch.where(d < a, drafted, bonus)
        st.out.index_copy_(0, (st.pos + d).clamp(max=st.out.numel() - 1), new)
        s = st.step.clamp(max=st.acc.numel() - 1)
        st.acc.index_copy_(0, s, a)
        div = torch.zeros_like(a)
        if self.oracle is not None:
            # did the target leave the oracle's continuation here (a bf16 near-tie, usually)?
            expected = self.oracle.token_at(st.pos + a)
            div = (bonus != expected).long()
            row = self.logits.index_select(0, end)[0]
            st.div.index_copy_(0, s, div)
            st.gap.index_copy_(0, s, row.index_select(0, bonus) - row.index_select(0, expected))
        result = torch.cat([a, end, bonus, path])
        st.log.result.index_copy_(0, st.log.row(st.step), result[None])
        st.pos.add_(a + 1)
        st.root.copy_(bonus)
        st.step.add_(1)
        st.last.copy_(torch.cat([a, end, bonus, div, st.pos]))
        self.result.copy_(result)

    def draft(self) -> None:
        if self.drafter is not None:
            self.drafter.draft(self)
        elif self.oracle is not None:
            self.oracle.draft(self.tokens, self.topo, self.state.pos, self.state.step)

    def _body(self, phase: str) -> Callable[[], None]:
        return {"verify": self.verify, "accept": self._accept, "draft": self.draft,
                "step": lambda: (self.verify(), self._accept(), self.draft())}[phase]

    def _capture_once(self, phase: str) -> None:
        t0 = time.perf_counter()
        # the warm-up runs the body for real: every static buffer it writes is put back
        extra = [self.tokens, self.result] + list(getattr(self.drafter, "buffers", list)())
        with self.state.preserved():
            saved = [t.clone() for t in extra]
            self.graphs[phase] = capture(self._body(phase))
            for t, s in zip(extra, saved):
                t.copy_(s)
        self.capture_ms += 1e3 * (time.perf_counter() - t0)

    # ---- running
    def run(self, phase: str) -> None:
        graph = self.graphs.get(phase)
        if graph is not None:
            graph.replay()
        else:
            self._body(phase)()

    def step(self) -> None:
        """One whole step: the one-step graph if captured, else the three phases in turn."""
        if "step" in self.graphs:
            self.graphs["step"].replay()
            return
        for phase in PHASES:
            self.run(phase)

    @torch.no_grad()
    def load_tree(self, tree: DraftTree) -> None:
        """The next step's draft from a host drafter (already padded to this graph's size)."""
        if self.dynamic:
            self.topo.load(tree)
        elif tree.parents != self.topo.tree.parents:
            raise ValueError("this graph was captured for another topology")
        self.set_draft(tree.tokens)

    @torch.no_grad()
    def set_draft(self, tokens: list[int]) -> None:
        """Drafted tokens for the next step from a host drafter (node 0, the root, is set by
        the graph from the previous bonus)."""
        if len(tokens) != self.topo.n:
            raise ValueError(f"{len(tokens)} tokens for a topology of {self.topo.n} nodes")
        self.tokens[0, 1:].copy_(torch.tensor(tokens[1:], dtype=torch.long), non_blocking=True)

    @torch.no_grad()
    def set_outcome(self, outcome: StepOutcome) -> None:
        """The host's acceptance of this step, for the `accept` phase (`host_accept=True`)."""
        P = self.state.max_path
        path = (outcome.path + [0] * P)[:P]
        self.result.copy_(torch.tensor([outcome.accepted, outcome.end, outcome.bonus] + path,
                                       dtype=torch.long))


def enqueue_phases(spec: GraphedSpec, steps: int, clock: PhaseClock) -> list:
    """Queue `steps` steps phase by phase, with no host sync. Returns the clock's marks: one
    before the steps (from the mark before it, the time the device waited for them) and one
    after each phase."""
    marks = [clock.stamp()]
    for _ in range(steps):
        for phase in PHASES:
            spec.run(phase)
            marks.append(clock.stamp())
    return marks


def step_times(gaps: list[float]) -> list[tuple[float, float, float]]:
    """Per step (verify, accept, draft) milliseconds from the gaps between a batch's phase marks."""
    return [tuple(gaps[3 * i:3 * i + 3]) for i in range(len(gaps) // 3)]


def replay_phases(spec: GraphedSpec, steps: int, clock: PhaseClock) -> list[tuple[float, float, float]]:
    """Replay `steps` steps phase by phase with a mark after each; per step the milliseconds
    of (verify, accept, draft), the draft being the next step's."""
    return step_times(clock.gaps(enqueue_phases(spec, steps, clock)))


@torch.no_grad()
def phase_times(spec: GraphedSpec, steps: int) -> dict:
    """Milliseconds per step of each phase (verify, accept_commit, draft) over `steps` steps
    from the spec's current state: the phase graphs replayed with CUDA events between them
    (host time when eager)."""
    times = replay_phases(spec, steps, PhaseClock(spec.rt.device))
    names = ("verify", "accept_commit", "draft")
    return {name: sum(t[i] for t in times) / max(steps, 1) for i, name in enumerate(names)}


@torch.no_grad()
def spec_vs_ar_noise(rt: PackedTarget, ar, snapshot: StaticState, root: int,
                     continuation: list[int], n: int = 16, recurrence: str = "kernels") -> float:
    """Max |logit difference| between a speculative chain forward and AR steps over the
    same tokens from the same state: the rounding noise a greedy flip must be within. Both
    verification paths are measured (the persistent chain launch, where it applies, and the
    per-op forward that trees take) and the larger noise returned."""
    n = min(n, len(continuation))
    forced = continuation[:n - 1]
    ar_logits = ar.logits_along(snapshot, root, forced)                   # [n, V]
    noise = 0.0
    for persistent in (True, False):
        state = SpecState(rt, max_path=n, capacity=n + 4)
        spec = GraphedSpec(rt, state, DraftTree.chain([root] + forced), mode="auto", use_graph=False,
                           recurrence=recurrence, persistent_verify=persistent)
        state.reset(snapshot, root)
        spec.verify()
        noise = max(noise, float((spec.logits - ar_logits).abs().max().item()))
        if spec.chain_verify is None:     # the per-op forward already: the second run would repeat it
            break
    return noise
