"""Actor: a policy's action network (Flatten -> [Linear, activation]* -> Linear), the one way specpilot runs one.

PPO inference (`Actor.from_sb3`, from a live SB3 policy's modules) and exported decoders (`Actor.from_layers`,
tensors read from safetensors) build the same class; export writes `to_layers()`. The deterministic action is the
argmax of the logits (the first index on exact ties, as torch.argmax and SB3's deterministic predict do).

Decision latency counts against the speedup: a decision runs right after a model forward has evicted the CPU caches,
where every distinct library call costs tens of microseconds (measured cold: one vector-matrix `@` ~60 us, a torch
linear ~180 us), and the depth policy decides after every draft level. So single decisions run in numpy, one
`np.dot` per layer on contiguous float32 copies of the weights (taken when the actor is built) with the bias as a
last row, into preallocated buffers; `decide(state, spec)` also folds the observation layout into the first layer
(the constant padding and mask go into its bias), so it skips building the observation vector, and where numba is
available runs the whole folded stack as one compiled call (`specpilot.policies.kernel`: ~30% less time per cold
decision than the numpy products, which stay as the fallback). A batch, weights on
an accelerator, observation normalisation or an activation without a numpy version go through torch functionals (the
same kernels nn.Linear uses).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from specpilot.drafting.types import DraftState
from specpilot.policies import kernel
from specpilot.policies.observation import ObservationSpec, fold_first_layer, observe, scalars

# name -> (numpy version or None, torch version); params carry e.g. a LeakyReLU's negative_slope
ACTIVATIONS = {
    "tanh": (lambda x, p: np.tanh(x, out=x), lambda x, p: torch.tanh(x)),
    "relu": (lambda x, p: np.maximum(x, 0.0, out=x), lambda x, p: torch.relu(x)),
    "leakyrelu": (lambda x, p: np.where(x >= 0, x, x * np.float32(p.get("negative_slope", 0.01))),
                  lambda x, p: F.leaky_relu(x, float(p.get("negative_slope", 0.01)))),
    "elu": (None, lambda x, p: F.elu(x, float(p.get("alpha", 1.0)))),
    "gelu": (None, lambda x, p: F.gelu(x, approximate=str(p.get("approximate", "none")))),
    "silu": (lambda x, p: x / (1.0 + np.exp(-x)), lambda x, p: F.silu(x)),
    "sigmoid": (lambda x, p: 1.0 / (1.0 + np.exp(-x)), lambda x, p: torch.sigmoid(x)),
    "identity": (lambda x, p: x, lambda x, p: x),
}
_PARAM_ATTRS = ("negative_slope", "alpha", "approximate")


class ActorError(ValueError):
    """An actor cannot be built from what it was given; the message names the layer and what to do."""



def _vec_normalize_stats(algorithm) -> tuple | None:
    """(mean, std, clip) of the VecNormalize an SB3 algorithm trained under, when it normalised observations."""
    get = getattr(algorithm, "get_vec_normalize_env", None)
    venv = get() if callable(get) else None
    if venv is None or not getattr(venv, "norm_obs", False):
        return None
    rms = venv.obs_rms
    if isinstance(rms, dict):
        raise ActorError("the policy was trained under VecNormalize with dict observations; specpilot's "
                         "observations are one vector")
    mean = torch.as_tensor(rms.mean, dtype=torch.float64)
    std = torch.sqrt(torch.as_tensor(rms.var, dtype=torch.float64) + float(venv.epsilon))
    return mean, std, float(venv.clip_obs)

class Actor:
    """A Linear/activation stack. layers: ("linear", weight [out, in], bias [out] | None) and
    ("activation", name, params) tuples in order. obs_norm: None or (mean, std, clip) float64 tensors, applied as
    clamp((obs - mean) / std, -clip, clip) like SB3's VecNormalize."""

    def __init__(self, layers: list[tuple], *, obs_norm: tuple | None = None, source: str = "actor") -> None:
        self.layers, self.obs_norm, self.source = list(layers), obs_norm, source
        linears = [layer for layer in self.layers if layer[0] == "linear"]
        if not linears:
            raise ActorError(f"{source}: the actor has no Linear layer")
        width = None
        for i, layer in enumerate(self.layers):
            if layer[0] == "linear":
                weight, bias = layer[1], layer[2]
                if width is not None and weight.shape[1] != width:
                    raise ActorError(f"{source}: layer {i} takes {weight.shape[1]} inputs but the previous layer "
                                     f"gives {width}")
                if bias is not None and tuple(bias.shape) != (weight.shape[0],):
                    raise ActorError(f"{source}: layer {i} has a bias of shape {tuple(bias.shape)} for "
                                     f"{weight.shape[0]} outputs")
                width = weight.shape[0]
            elif layer[0] != "activation" or str(layer[1]).lower() not in ACTIVATIONS:
                raise ActorError(f"{source}: layer {i} is {layer[:2]!r}; supported: Linear and activations "
                                 f"{sorted(ACTIVATIONS)}")
        self.in_features = int(linears[0][1].shape[1])
        self.n_actions = int(linears[-1][1].shape[0])
        self.device = linears[0][1].device
        self._numpy_steps = self._numpy_plan()
        self._fold_spec = self._folded = None  # the spec `decide` last folded the first layer with, and the tables

    def __getstate__(self) -> dict:
        # the numpy plan's outputs are views of the next layer's input buffer: pickling (Ray workers get partner
        # controllers) or deepcopy would turn them into separate arrays, so the plan is rebuilt on arrival instead
        state = dict(self.__dict__)
        state["_numpy_steps"] = state["_fold_spec"] = state["_folded"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._numpy_steps = self._numpy_plan()

    # -- construction -------------------------------------------------------------------------------------------
    @classmethod
    def from_sb3(cls, policy) -> "Actor":
        """The actor of an SB3 ActorCriticPolicy (or algorithm) with a Flatten features extractor and an MLP:
        mlp_extractor.policy_net then action_net. Decisions use copies of the weights taken now: after training
        updates the policy, build a new Actor (every caller builds its controller after the update). An algorithm
        trained under VecNormalize(norm_obs=True) brings its observation statistics (the policy saw normalised
        observations: deciding on raw ones would be another policy)."""
        norm = _vec_normalize_stats(policy)
        policy = getattr(policy, "policy", policy)
        extractor = getattr(policy, "pi_features_extractor", None) or getattr(policy, "features_extractor", None)
        if type(getattr(extractor, "flatten", None)) is not torch.nn.Flatten:
            raise ActorError(f"cannot run a policy with features extractor {type(extractor).__name__}: only SB3's "
                             "MlpPolicy (FlattenExtractor) is supported")
        layers: list[tuple] = []
        for module in list(policy.mlp_extractor.policy_net) + [policy.action_net]:
            if isinstance(module, torch.nn.Linear):
                layers.append(("linear", module.weight.detach(),
                               None if module.bias is None else module.bias.detach()))
            else:
                params = {a: getattr(module, a) for a in _PARAM_ATTRS if hasattr(module, a)}
                layers.append(("activation", type(module).__name__.lower(), params))
        return cls(layers, obs_norm=norm, source=f"SB3 {type(policy).__name__}")

    @classmethod
    def from_layers(cls, entries: list[dict], tensors: dict[str, torch.Tensor], *, obs_norm: dict | None = None,
                    source: str = "actor") -> "Actor":
        """From the exported layer list ({"kind": "linear", "in", "out", "weight", "bias"} / {"kind": "activation",
        "name", ...params}) and its named tensors; shapes are checked against the recorded in/out sizes."""
        def tensor(key):
            if key not in tensors:
                raise ActorError(f"{source}: tensor {key!r} is missing from the weights file")
            return tensors[key].detach().float().contiguous()

        layers = []
        for i, entry in enumerate(entries):
            if entry.get("kind") == "linear":
                weight = tensor(entry.get("weight"))
                bias = tensor(entry["bias"]) if entry.get("bias") else None
                if tuple(weight.shape) != (int(entry["out"]), int(entry["in"])):
                    raise ActorError(f"{source}: layer {i} is recorded as Linear({entry['in']}, {entry['out']}) but "
                                     f"its weight has shape {tuple(weight.shape)}")
                layers.append(("linear", weight, bias))
            elif entry.get("kind") == "activation":
                params = {k: v for k, v in entry.items() if k not in ("kind", "name")}
                layers.append(("activation", str(entry.get("name", "")).lower(), params))
            else:
                raise ActorError(f"{source}: layer {i} has unknown kind {entry.get('kind')!r}")
        norm = None
        if obs_norm:
            mean, var = tensor(obs_norm.get("mean")).double(), tensor(obs_norm.get("var")).double()
            eps, clip = float(obs_norm.get("epsilon", 1e-8)), float(obs_norm.get("clip", 10.0))
            norm = (mean, torch.sqrt(var + eps), clip)
        actor = cls(layers, obs_norm=norm, source=source)
        if norm is not None and tuple(norm[0].shape) != (actor.in_features,):
            raise ActorError(f"{source}: observation-normalisation statistics have shape {tuple(norm[0].shape)}, "
                             f"expected ({actor.in_features},)")
        return actor

    def to_layers(self, prefix: str) -> tuple[list[dict], dict[str, torch.Tensor]]:
        """The exported layer list and named float32 CPU tensors (copies)."""
        entries: list[dict] = []
        tensors: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if layer[0] == "linear":
                weight, bias = layer[1], layer[2]
                entry = {"kind": "linear", "in": int(weight.shape[1]), "out": int(weight.shape[0]),
                         "weight": f"{prefix}.{i}.weight", "bias": None}
                tensors[entry["weight"]] = weight.detach().to("cpu", torch.float32).contiguous().clone()
                if bias is not None:
                    entry["bias"] = f"{prefix}.{i}.bias"
                    tensors[entry["bias"]] = bias.detach().to("cpu", torch.float32).contiguous().clone()
                entries.append(entry)
            else:
                entries.append({"kind": "activation", "name": str(layer[1]).lower(), **layer[2]})
        return entries, tensors

    # -- decisions ----------------------------------------------------------------------------------------------
    def _numpy_plan(self) -> list[tuple] | None:
        """Single decisions in numpy, or None when numpy cannot run the stack: one step per Linear, (matrix, input,
        output, activation fn, params). The matrix is [W.T; bias] (in + 1, out), contiguous float32, read by one
        `np.dot` from an input buffer whose last slot holds a constant 1; each output is a view of the next step's
        input buffer (the last one the logits), so a decision allocates nothing. The matrices are copies, made once
        (a check per decision that live weights did not change would cost as much as a layer)."""
        if self.obs_norm is not None or self.n_actions < 2:  # (one output would read as a logit difference)
            return None
        linears: list[list] = []
        for layer in self.layers:
            if layer[0] == "linear":
                weight, bias = layer[1], layer[2]
                if weight.device.type != "cpu" or weight.dtype != torch.float32:
                    return None
                w = weight.detach().numpy()
                b = np.zeros(w.shape[0], np.float32) if bias is None else bias.detach().numpy()
                linears.append([np.ascontiguousarray(np.concatenate([w.T, b[None, :]]), dtype=np.float32),
                                None, None])
            else:
                fn = ACTIVATIONS[str(layer[1]).lower()][0]
                if fn is None or not linears or linears[-1][1] is not None:
                    return None
                linears[-1][1:] = [fn, layer[2]]
        if linears[-1][0].shape[1] == 2 and linears[-1][1] is None:  # two actions: one column, l1 - l0
            diff = linears[-1][0][:, 1:].astype(np.float64) - linears[-1][0][:, :1]
            linears[-1][0] = np.ascontiguousarray(diff, dtype=np.float32)
        inputs = [np.ones(matrix.shape[0], np.float32) for matrix, _, _ in linears]  # [x, 1]
        outputs = [x[:-1] for x in inputs[1:]] + [np.empty(linears[-1][0].shape[1], np.float32)]
        return [(matrix, x, y, fn, params) for (matrix, fn, params), x, y in zip(linears, inputs, outputs)]

    @staticmethod
    def _forward(steps: list[tuple], x: np.ndarray | None = None, matrix: np.ndarray | None = None) -> int:
        """Run the steps (their inputs filled) and return the argmax of the logits, the first index on exact ties
        (as torch.argmax). x, matrix: another input and matrix for the first step (a folded first layer). A last
        step with one output is a two-action layer reduced to the logits' difference: action 1 iff l1 - l0 > 0
        (.item(): measured cheaper after a model forward than argmax or a vector-vector np.dot)."""
        for w, inp, y, fn, params in steps:
            if x is not None:
                inp, w, x = x, matrix, None
            np.dot(inp, w, out=y)
            if fn is not None:
                z = fn(y, params)
                if z is not y:
                    y[...] = z
        return int(y.item() > 0.0) if y.shape[0] == 1 else int(y.argmax())

    def act(self, obs: np.ndarray) -> int:
        """Deterministic action for one float32 observation vector."""
        steps = self._numpy_steps
        if steps is None:
            with torch.inference_mode():
                return int(self.logits(torch.from_numpy(obs).to(self.device).unsqueeze(0)).argmax(dim=1))
        steps[0][1][:-1] = obs
        return self._forward(steps)

    def decide(self, state: DraftState, spec: ObservationSpec) -> int:
        """Deterministic action for a DraftState, as act(observe(state, spec)) decides up to float round-off, but
        without building the observation: the first layer is folded with the observation layout
        (`fold_first_layer`), so a decision is one clipping ufunc on the real scores, one write of the scalars and
        one np.dot per layer. Falls back to act(observe(...)) where numpy cannot run the stack."""
        steps = self._numpy_steps
        if steps is None:
            return self.act(observe(state, spec))
        # one cached spec, compared by identity: hashing a spec (8 fields) would cost more than the rest
        folded = self._folded if spec is self._fold_spec else self._fold(spec, steps[0])
        values = state.level_scores if folded[0] else state.candidate_scores
        if folded[3] is not None and values.dtype == np.float32:  # one compiled call (`policies.kernel`)
            run = folded[3]
            try:
                if folded[4]:  # candidate depths: the kernel reads each one from the candidate's node id
                    return run[0](values, state.candidate_ids, scalars(state, spec), run[1], run[2])
                return run[0](values, scalars(state, spec), run[1], run[2])
            except TypeError:  # scores the compiled signature cannot unbox (never seen: a guard): numpy decides
                pass
        k = values.shape[0]
        if k > folded[1]:
            k = folded[1]
            values = values[:k]
        if folded[4]:  # numpy reads [scores, depths] as one input of 2k slots
            values = np.concatenate((values, state.candidate_depths[:k]))
        matrix, x, head, tail, floor = folded[2][k]
        if k:  # (depth 0, the skip decision, has no scores)
            # clip at score_floor (the scale is in the matrix); an array bound of the same dtype takes numpy's
            # shortest path (a Python float goes through scalar promotion: measured ~15 us more after a forward).
            # The observation also clips at 0, a guard against round-off above 0 (scores are log-probs, <= 0):
            # such a score moves a logit by ~1e-9 here, less than the fold's own round-off, so it is not repeated.
            # Depths (>= 1) pass the floor unchanged.
            np.maximum(values, floor, out=head)
        tail[...] = scalars(state, spec)
        return self._forward(steps, x, matrix)

    def _fold(self, spec: ObservationSpec, first: tuple) -> tuple:
        """(depth kind?, num_scores, per count k of real scores: (folded matrix, input buffer [scores, scalars, 1],
        its score view, its scalar view, floor bounds)), made once per spec."""
        if spec.dim != self.in_features:
            raise ActorError(f"{self.source}: the actor takes {self.in_features} inputs but the {spec.kind} "
                             f"observation spec produces {spec.dim}")
        weight, bias = first[0][:-1].T, first[0][-1]
        slots = 2 if spec.candidate_depths else 1  # inputs per real candidate: its score (and its depth)
        floor = np.full(slots * spec.num_scores, spec.score_floor, np.float32)
        tables = []
        matrices = fold_first_layer(spec, weight, bias)
        for k, matrix in enumerate(matrices):
            x = np.ones(matrix.shape[0], np.float32)
            tables.append((matrix, x, x[:slots * k], x[slots * k:-1], floor[:slots * k]))
        self._fold_spec, self._folded = spec, (spec.kind == "depth", spec.num_scores, tables,
                                               self._pack(spec, matrices), slots == 2)
        return self._folded

    def prepare(self, spec: ObservationSpec) -> None:
        """Fold the first layer for `spec` (and compile the kernel for it) now rather than in the first decision,
        which a clock may be timing (controllers call this when they are built)."""
        if self._numpy_steps is not None and spec is not self._fold_spec:
            self._fold(spec, self._numpy_steps[0])

    @property
    def compiled(self) -> bool:
        """Whether decisions run through the compiled kernel (for the spec folded last)."""
        return self._folded is not None and self._folded[3] is not None

    def _pack(self, spec: ObservationSpec, matrices: list[np.ndarray]) -> tuple | None:
        """(the compiled kernel, its weights, its layout) for `spec`, compiled now and tried on contiguous and
        strided score views, or None where the kernel cannot run this actor (no numba, an activation it lacks, a
        failed compile). With candidate depths it is `decide_depths`, which reads them from the node ids (no numpy
        call per decision: after a model forward each one costs tens of microseconds)."""
        depths = spec.candidate_depths
        run = kernel.compiled(spec.num_scalars, depths=depths)
        if run is None:
            return None
        codes = []  # the activation after each Linear (0: none)
        for _, _, _, fn, _ in self._numpy_steps:
            code = 0 if fn is None else kernel.ACTIVATION_CODES.get(self._activation_name(fn))
            if code is None:
                return None
            codes.append(code)
        packed = kernel.pack(matrices, [step[0] for step in self._numpy_steps[1:]], codes, spec.num_scalars,
                             spec.score_floor, width=spec.width if depths else None)
        try:
            probe = np.full(2 * spec.num_scores, spec.score_floor / 2, np.float32)
            ids = np.arange(2 * spec.num_scores, dtype=np.int64)
            blank = (0.5,) * spec.num_scalars
            for scores in (probe[:spec.num_scores], probe[::2]):  # contiguous and strided score views
                run(scores, ids[::2], blank, *packed) if depths else run(scores, blank, *packed)
        except Exception:  # noqa: BLE001 - the numpy path decides instead
            return None
        return (run, *packed)

    @staticmethod
    def _activation_name(fn) -> str:
        return next(name for name, (numpy_fn, _) in ACTIVATIONS.items() if numpy_fn is fn)

    def logits(self, obs: torch.Tensor) -> torch.Tensor:
        """(batch, in_features) float32 -> (batch, n_actions) logits, with torch functionals."""
        x = obs
        if self.obs_norm is not None:
            mean, std, clip = self.obs_norm
            x = torch.clamp((x.double() - mean) / std, -clip, clip).float()
        for layer in self.layers:
            if layer[0] == "linear":
                x = F.linear(x, layer[1], layer[2])
            else:
                x = ACTIVATIONS[str(layer[1]).lower()][1](x, layer[2])
        return x

    def act_batch(self, obs: np.ndarray | torch.Tensor) -> np.ndarray:
        with torch.inference_mode():
            x = torch.as_tensor(obs, dtype=torch.float32).to(self.device)
            return self.logits(x).argmax(dim=1).cpu().numpy()
