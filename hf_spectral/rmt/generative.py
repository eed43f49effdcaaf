"""The generative model of SPEC 3.1 as a seeded sampler.

* A vocabulary table E ∈ R^{d×V}: e_v = s_v μ + z_v with balanced signs s_v = ±1 (the first V/2 tokens are +1)
  and z_v ~ N(0, I_d).
* Per sequence a sign vector ξ ∈ {±1}^T with E[ξξᵀ] = R (a position-correlation model below); the token at
  position t is drawn uniformly from the half of the vocabulary whose sign is ξ_t.
* Pooled c = Σ_t w_t e_{v_t}.

Table conventions (``table=``):

* ``"class_centred"`` (default): the noise vectors of each sign class have zero mean (and are rescaled by
  √(m/(m−1)), m = V/2, so that their within-class covariance keeps expectation I). The theory of
  ``hf_spectral.rmt.theory`` holds for this table as written.
* ``"raw"``: plain Gaussian noise. Its class means (squared norm ≈ 2δ each) then act as part of the signal,
  ‖μ‖² → ‖μ‖² + δ, and their common part a = (z̄₊ + z̄₋)/2 (‖a‖² ≈ δ) shifts every pooled vector by (Σ_t w_t) a:
  an extra rank-one term in the uncentred S = (1/N) Σ c cᵀ that the class-centred table does not have.

Position-correlation models sample signs whose second moment is *exactly* R: the prefix block and AR(1) by
construction, a user matrix through Gaussian signs (ξ = sign(g), g ~ N(0, sin(πR/2)), since E[sign(g_i) sign(g_j)]
= (2/π) arcsin Σ_ij). Not every correlation matrix is the second moment of ±1 variables; when sin(πR/2) is not
positive semi-definite that sampler refuses R with a ValueError.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sparse

__all__ = [
    "validate_correlation_matrix",
    "validate_weights",
    "PositionCorrelation",
    "PrefixCorrelation",
    "AR1Correlation",
    "MatrixCorrelation",
    "EmbeddingTable",
    "sample_table",
    "sample_tokens",
    "pool_tokens",
    "PooledSample",
    "sample_pooled",
    "TABLES",
]

TABLES = ("class_centred", "raw")


def _rng(seed_or_rng) -> np.random.Generator:
    return seed_or_rng if isinstance(seed_or_rng, np.random.Generator) else np.random.default_rng(seed_or_rng)


def validate_correlation_matrix(R, *, name: str = "R", atol: float = 1e-8) -> np.ndarray:
    """Return R as a float array after checking that it is a position-correlation matrix.

    Raises ValueError unless R is a finite square T×T matrix (T ≥ 1) that is symmetric, has unit diagonal and is
    positive semi-definite (smallest eigenvalue ≥ −atol·T).
    """
    R = np.asarray(R, dtype=float)
    if R.ndim != 2 or R.shape[0] != R.shape[1] or R.shape[0] == 0:
        raise ValueError(f"{name} must be a square T×T matrix, got shape {R.shape}")
    if not np.all(np.isfinite(R)):
        raise ValueError(f"{name} has non-finite entries")
    if not np.allclose(R, R.T, atol=atol, rtol=0):
        raise ValueError(f"{name} must be symmetric (max |R − Rᵀ| = {np.abs(R - R.T).max():.3g})")
    if not np.allclose(np.diag(R), 1.0, atol=atol, rtol=0):
        raise ValueError(f"{name} must have unit diagonal (E[ξ_t²] = 1), got diagonal in "
                         f"[{np.diag(R).min():.4g}, {np.diag(R).max():.4g}]")
    smallest = np.linalg.eigvalsh((R + R.T) / 2)[0]
    if smallest < -atol * R.shape[0]:
        raise ValueError(f"{name} must be positive semi-definite, smallest eigenvalue {smallest:.3g}")
    return R


def validate_weights(w, T: int | None = None, *, name: str = "w") -> np.ndarray:
    """Return pooling weights as a 1-D float array; ValueError on wrong shape, non-finite or all-zero weights."""
    w = np.asarray(w, dtype=float)
    if w.ndim != 1 or w.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D vector of per-position weights, got shape {w.shape}")
    if T is not None and w.size != T:
        raise ValueError(f"{name} has {w.size} positions, expected T = {T}")
    if not np.all(np.isfinite(w)):
        raise ValueError(f"{name} has non-finite entries")
    if not np.any(w):
        raise ValueError(f"{name} is all zeros")
    return w


class PositionCorrelation:
    """A model of the sign vector ξ ∈ {±1}^T with E[ξξᵀ] = ``matrix`` and E[ξ] = 0."""

    matrix: np.ndarray

    @property
    def length(self) -> int:
        return self.matrix.shape[0]

    def sample_signs(self, n: int, rng=None) -> np.ndarray:
        """(n, T) float array of ±1 signs (float so that products such as ξᵀξ cannot overflow)."""
        raise NotImplementedError

    def top_eigenvector(self) -> np.ndarray:
        """Unit top eigenvector of R, sign fixed so that its entries sum to ≥ 0 (the optimal pooling weights)."""
        values, vectors = np.linalg.eigh(self.matrix)
        top = vectors[:, -1]
        return top if top.sum() >= 0 else -top

    def labels(self, signs: np.ndarray) -> np.ndarray:
        """Sequence label ±1 used by the downstream experiment: sign(u_Rᵀ ξ), u_R = ``top_eigenvector()``.

        For the prefix model this is the shared sign of the first L positions. Ties (u_Rᵀξ = 0, possible only
        when R's top eigenvector has equal-magnitude entries of both signs) go to +1.
        """
        score = np.asarray(signs, dtype=float) @ self.top_eigenvector()
        return np.where(score >= 0, 1.0, -1.0)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(T={self.length})"


class PrefixCorrelation(PositionCorrelation):
    """The first L positions share one sign; the other T − L signs are independent. R = blockdiag(1_L 1_Lᵀ, I).

    This is the "signal sits early" model of SPEC 3.2: mean pooling has α/κ = (L² + T − L)/T, the optimal weights
    (uniform on the prefix) have α/κ = L.
    """

    def __init__(self, length: int, prefix: int):
        if not (isinstance(length, (int, np.integer)) and length >= 1):
            raise ValueError(f"length T must be a positive integer, got {length!r}")
        if not (isinstance(prefix, (int, np.integer)) and 1 <= prefix <= length):
            raise ValueError(f"prefix L must be an integer in [1, T={length}], got {prefix!r}")
        self.prefix = int(prefix)
        R = np.eye(length)
        R[:prefix, :prefix] = 1.0
        self.matrix = R

    def sample_signs(self, n, rng=None):
        rng = _rng(rng)
        signs = rng.choice(np.array([-1.0, 1.0]), size=(n, self.length))
        signs[:, : self.prefix] = signs[:, :1]
        return signs

    def top_eigenvector(self):
        """Uniform on the prefix. (For L = 1, R = I: every unit vector is a top eigenvector, and the model's label is
        the first position's sign, so e_1 is the one that labels and pools it.)"""
        weights = np.zeros(self.length)
        weights[: self.prefix] = 1.0 / np.sqrt(self.prefix)
        return weights

    def __repr__(self):
        return f"PrefixCorrelation(T={self.length}, L={self.prefix})"


class AR1Correlation(PositionCorrelation):
    """R_ij = r^|i−j|, sampled exactly as a symmetric two-state Markov chain that keeps its sign with
    probability (1 + r)/2 (then E[ξ_i ξ_j] = r^|i−j|); −1 ≤ r ≤ 1."""

    def __init__(self, length: int, r: float):
        if not (isinstance(length, (int, np.integer)) and length >= 1):
            raise ValueError(f"length T must be a positive integer, got {length!r}")
        if not (np.isfinite(r) and -1.0 <= r <= 1.0):
            raise ValueError(f"AR(1) correlation r must lie in [−1, 1], got {r!r}")
        self.r = float(r)
        lags = np.abs(np.subtract.outer(np.arange(length), np.arange(length)))
        self.matrix = np.power(self.r, lags)

    def sample_signs(self, n, rng=None):
        rng = _rng(rng)
        first = rng.choice(np.array([-1.0, 1.0]), size=(n, 1))
        keep = np.where(rng.random((n, self.length - 1)) < (1 + self.r) / 2, 1.0, -1.0)
        return first * np.concatenate([np.ones((n, 1)), np.cumprod(keep, axis=1)], axis=1)

    def __repr__(self):
        return f"AR1Correlation(T={self.length}, r={self.r})"


class MatrixCorrelation(PositionCorrelation):
    """Any user correlation matrix R (validated), sampled as ξ = sign(g), g ~ N(0, sin(πR/2)).

    Raises ValueError if R is not a correlation matrix, or if sin(πR/2) is not positive semi-definite (then no
    Gaussian-sign model has second moment R; ±1 vectors cannot realise every correlation matrix).
    """

    def __init__(self, R):
        self.matrix = validate_correlation_matrix(R)
        latent = np.sin(np.pi * self.matrix / 2)
        values, vectors = np.linalg.eigh(latent)
        if values[0] < -1e-8 * len(values):
            raise ValueError(
                "R is a valid correlation matrix but not reachable with Gaussian signs: sin(πR/2) has eigenvalue "
                f"{values[0]:.3g} < 0. Use a prefix/AR(1) model or a matrix closer to the identity."
            )
        self._factor = vectors * np.sqrt(np.clip(values, 0, None))

    def sample_signs(self, n, rng=None):
        rng = _rng(rng)
        g = rng.standard_normal((n, self.length)) @ self._factor.T
        return np.where(g >= 0, 1.0, -1.0)


@dataclass
class EmbeddingTable:
    """A vocabulary table E = μ sᵀ + Z (columns are tokens).

    Attributes:
        noise: (d, V) noise vectors z_v (class-centred or raw, see ``table``).
        signs: (V,) ±1 class of each token; tokens [0, V/2) are +1, [V/2, V) are −1.
        mu: (d,) signal vector μ.
        table: ``"class_centred"`` or ``"raw"`` (module docstring).
    """

    noise: np.ndarray
    signs: np.ndarray
    mu: np.ndarray
    table: str

    @property
    def dim(self) -> int:
        return self.noise.shape[0]

    @property
    def vocab_size(self) -> int:
        return self.noise.shape[1]

    @property
    def delta(self) -> float:
        return self.dim / self.vocab_size

    @property
    def signal_direction(self) -> np.ndarray:
        """u = μ/‖μ‖ (the first basis vector when μ = 0)."""
        norm = np.linalg.norm(self.mu)
        if norm == 0:
            u = np.zeros(self.dim)
            u[0] = 1.0
            return u
        return self.mu / norm

    @property
    def embeddings(self) -> np.ndarray:
        """(d, V) table E."""
        return self.noise + np.outer(self.mu, self.signs)


def sample_table(dim: int, vocab_size: int, mu_norm2: float, *, table: str = "class_centred",
                 rng=None) -> EmbeddingTable:
    """Draw a vocabulary table with ‖μ‖² = ``mu_norm2`` along a uniformly random direction.

    ``vocab_size`` must be even (balanced signs) and ≥ 4 (the class-centring rescale needs two tokens per class).
    """
    rng = _rng(rng)
    if not (isinstance(dim, (int, np.integer)) and dim >= 1):
        raise ValueError(f"dim must be a positive integer, got {dim!r}")
    if not (isinstance(vocab_size, (int, np.integer)) and vocab_size >= 4 and vocab_size % 2 == 0):
        raise ValueError(f"vocab_size must be an even integer >= 4 (balanced ± classes), got {vocab_size!r}")
    if not (np.isfinite(mu_norm2) and mu_norm2 >= 0):
        raise ValueError(f"mu_norm2 = ‖μ‖² must be finite and >= 0, got {mu_norm2!r}")
    if table not in TABLES:
        raise ValueError(f"table must be one of {TABLES}, got {table!r}")
    half = vocab_size // 2
    signs = np.concatenate([np.ones(half), -np.ones(half)])
    noise = rng.standard_normal((dim, vocab_size))
    if table == "class_centred":
        for block in (slice(0, half), slice(half, vocab_size)):
            noise[:, block] -= noise[:, block].mean(axis=1, keepdims=True)
            noise[:, block] *= np.sqrt(half / (half - 1))
    direction = rng.standard_normal(dim)
    mu = np.sqrt(mu_norm2) * direction / np.linalg.norm(direction)
    return EmbeddingTable(noise=noise, signs=signs, mu=mu, table=table)


def sample_tokens(table: EmbeddingTable, signs: np.ndarray, rng=None) -> np.ndarray:
    """(n, T) token ids: position t drawn uniformly from the vocabulary half whose sign is ξ_t."""
    rng = _rng(rng)
    signs = np.asarray(signs)
    half = table.vocab_size // 2
    offset = rng.integers(0, half, size=signs.shape)
    return np.where(signs > 0, offset, half + offset)


def pool_tokens(table: EmbeddingTable, tokens: np.ndarray, weights) -> np.ndarray:
    """(n, d) pooled vectors c_n = Σ_t w_t e_{v_nt}, computed as E B with a sparse (V, n) token-weight matrix B
    (cost d · n · #{t : w_t ≠ 0}, never materialising the (n, T, d) token embeddings)."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be (n, T), got shape {tokens.shape}")
    w = validate_weights(weights, tokens.shape[1], name="weights")
    used = np.flatnonzero(w)
    n = tokens.shape[0]
    B = sparse.csr_matrix(
        (np.tile(w[used], n), (tokens[:, used].ravel(), np.repeat(np.arange(n), used.size))),
        shape=(table.vocab_size, n),
    )
    return np.asarray((B.T @ table.embeddings.T))


@dataclass
class PooledSample:
    """``vectors``: (n, d) pooled c_n; ``signs``: (n, T) ξ; ``tokens``: (n, T) token ids; ``labels``: (n,) ±1
    sequence labels (``PositionCorrelation.labels``)."""

    vectors: np.ndarray
    signs: np.ndarray
    tokens: np.ndarray
    labels: np.ndarray


def sample_pooled(table: EmbeddingTable, correlation: PositionCorrelation, weights, n: int,
                  rng=None) -> PooledSample:
    """Draw n sequences from ``correlation`` and ``table`` and pool them with ``weights`` (length T)."""
    rng = _rng(rng)
    if not (isinstance(n, (int, np.integer)) and n >= 1):
        raise ValueError(f"n must be a positive integer, got {n!r}")
    validate_weights(weights, correlation.length, name="weights")
    signs = correlation.sample_signs(n, rng)
    tokens = sample_tokens(table, signs, rng)
    return PooledSample(pool_tokens(table, tokens, weights), signs, tokens, correlation.labels(signs))
