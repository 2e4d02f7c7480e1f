"""``FactoredMatrix``: a matrix kept as the product of two factors, ``A @ B``, as TransformerLens documents it (the
Main Demo's circuits section: ``model.QK``, ``model.OV``). Products stay factored while that keeps them smaller; the
singular values and vectors come from the two factors, never from the full product."""

from __future__ import annotations

import torch

from ..utils import get_corner as _corner


class FactoredMatrix:
    """The matrix ``A @ B`` (``A`` ``[..., ldim, mdim]``, ``B`` ``[..., mdim, rdim]``, leading dimensions
    broadcast), with TransformerLens's operations: ``@`` on either side with a tensor or another factored matrix,
    ``* scalar``, ``AB``, ``BA``, ``T``, ``svd()`` (``U``, ``S``, ``V``: ``AB == U @ diag(S) @ V^T``),
    ``eigenvalues`` (of ``BA``, which are ``AB``'s non-zero ones), ``norm()`` (Frobenius), ``get_corner(k)``,
    indexing (leading dimensions, then rows, then columns), ``make_even``, ``collapse_l`` / ``collapse_r``,
    ``unsqueeze``, ``pair``."""

    def __init__(self, A: torch.Tensor, B: torch.Tensor):
        if A.dim() < 2 or B.dim() < 2 or A.shape[-1] != B.shape[-2]:
            raise ValueError(f"A FactoredMatrix is A [..., ldim, mdim] @ B [..., mdim, rdim]: the factors' inner "
                             f"dimensions must match, not {tuple(A.shape)} and {tuple(B.shape)}.")
        try:
            leading = torch.broadcast_shapes(A.shape[:-2], B.shape[:-2])
        except RuntimeError:
            raise ValueError(f"The factors' leading dimensions do not broadcast: {tuple(A.shape)} and "
                             f"{tuple(B.shape)}.") from None
        self.A = A.broadcast_to((*leading, *A.shape[-2:]))
        self.B = B.broadcast_to((*leading, *B.shape[-2:]))
        self.ldim, self.mdim, self.rdim = A.shape[-2], A.shape[-1], B.shape[-1]
        self.shape = torch.Size((*leading, self.ldim, self.rdim))
        self.has_leading_dims = len(leading) > 0
        self._svd = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.A, self.B

    @property
    def AB(self) -> torch.Tensor:
        """The full matrix ``[..., ldim, rdim]``."""
        return self.A @ self.B

    @property
    def BA(self) -> torch.Tensor:
        """The factors the other way round, ``[..., mdim, mdim]`` (a square matrix only: ``ldim == rdim``)."""
        if self.ldim != self.rdim:
            raise ValueError(f"BA needs a square matrix; this one is {self.ldim} x {self.rdim}.")
        return self.B @ self.A

    @property
    def T(self) -> FactoredMatrix:
        return FactoredMatrix(self.B.transpose(-2, -1), self.A.transpose(-2, -1))

    def __matmul__(self, other):
        if isinstance(other, FactoredMatrix):
            return (self @ other.A) @ other.B
        other = torch.as_tensor(other)
        if other.shape[0 if other.dim() == 1 else -2] != self.rdim:
            raise ValueError(f"A {tuple(self.shape)} matrix times one of shape {tuple(other.shape)}: the inner "
                             "dimensions differ.")
        if other.dim() == 1:  # a vector: a vector back, [..., ldim]
            return (self.A @ (self.B @ other[:, None]))[..., 0]
        # kept factored around the narrower of the two inner dimensions
        return FactoredMatrix(self.A, self.B @ other) if self.rdim > self.mdim else FactoredMatrix(self.AB, other)

    def __rmatmul__(self, other):
        other = torch.as_tensor(other)
        if other.shape[-1] != self.ldim:
            raise ValueError(f"A matrix of shape {tuple(other.shape)} times a {tuple(self.shape)} one: the inner "
                             "dimensions differ.")
        if other.dim() == 1:  # [..., rdim]
            return ((other[None] @ self.A) @ self.B)[..., 0, :]
        return FactoredMatrix(other @ self.A, self.B) if self.ldim > self.mdim else FactoredMatrix(other, self.AB)

    def __mul__(self, scalar) -> FactoredMatrix:
        scalar = torch.as_tensor(scalar)
        if scalar.numel() != 1:  # one number per matrix of the leading dimensions
            scalar = scalar[..., None, None]
        return FactoredMatrix(self.A * scalar, self.B)

    __rmul__ = __mul__

    def svd(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(U [..., ldim, k], S [..., k], V [..., rdim, k])`` with ``AB == U @ diag(S) @ V^T``, ``k`` the
        smallest of the three dimensions: from QR factors of ``A`` and ``B^T`` and the SVD of their small
        middle, never from ``AB`` itself."""
        if self._svd is None:
            qa, ra = torch.linalg.qr(self.A)
            qb, rb = torch.linalg.qr(self.B.transpose(-2, -1))
            u, s, vh = torch.linalg.svd(ra @ rb.transpose(-2, -1), full_matrices=False)
            self._svd = qa @ u, s, qb @ vh.transpose(-2, -1)
        return self._svd

    @property
    def U(self) -> torch.Tensor:
        return self.svd()[0]

    @property
    def S(self) -> torch.Tensor:
        return self.svd()[1]

    @property
    def V(self) -> torch.Tensor:
        return self.svd()[2]

    @property
    def Vh(self) -> torch.Tensor:
        """``V`` (TransformerLens's ``Vh`` has always been V, the right singular vectors as columns)."""
        return self.V

    @property
    def eigenvalues(self) -> torch.Tensor:
        """The eigenvalues of ``BA`` (complex), the non-zero eigenvalues of ``AB`` (computed in float32 for a
        16-bit matrix)."""
        square = self.BA
        return torch.linalg.eigvals(square.float() if square.dtype in (torch.float16, torch.bfloat16) else square)

    def norm(self) -> torch.Tensor:
        """The Frobenius norm, ``[...]``: the root of the sum of the squared singular values."""
        return self.S.pow(2).sum(-1).sqrt()

    def get_corner(self, k: int = 3) -> torch.Tensor:
        """The top-left ``k`` x ``k`` of the matrix (the first ``k`` of every leading dimension too)."""
        return _corner(self.A[..., :k, :] @ self.B[..., :, :k], k)

    def make_even(self) -> FactoredMatrix:
        """The same matrix as ``(U sqrt(S)) @ (sqrt(S) V^T)``: each factor holds half of the singular values."""
        root = self.S.sqrt()
        return FactoredMatrix(self.U * root[..., None, :], root[..., :, None] * self.V.transpose(-2, -1))

    def collapse_l(self) -> torch.Tensor:
        """``diag(S) @ V^T``, ``[..., k, rdim]``: the matrix without its left orthogonal factor."""
        return self.S[..., :, None] * self.V.transpose(-2, -1)

    def collapse_r(self) -> torch.Tensor:
        """``U @ diag(S)``, ``[..., ldim, k]``."""
        return self.U * self.S[..., None, :]

    def unsqueeze(self, k: int) -> FactoredMatrix:
        return FactoredMatrix(self.A.unsqueeze(k), self.B.unsqueeze(k))

    def __getitem__(self, index) -> FactoredMatrix:
        """Leading dimensions index both factors; then rows index ``A`` and columns ``B``. An int row or column keeps
        its dimension (the result is still a matrix)."""
        index = index if isinstance(index, tuple) else (index,)
        leading = len(self.shape) - 2
        if len(index) > leading + 2:
            raise IndexError(f"{index} has too many entries for a FactoredMatrix of shape {tuple(self.shape)}.")
        if len(index) <= leading:
            return FactoredMatrix(self.A[index], self.B[index])
        kept = tuple(slice(i, i + 1 if i != -1 else None) if isinstance(i, int) else i for i in index[leading:])
        head = index[:leading]
        rows = kept[0] if kept else slice(None)
        columns = kept[1] if len(kept) > 1 else slice(None)
        return FactoredMatrix(self.A[(*head, rows, slice(None))], self.B[(*head, slice(None), columns)])

    def __repr__(self) -> str:
        return f"FactoredMatrix: Shape({self.shape}), Hidden Dim({self.mdim})"


__all__ = ["FactoredMatrix"]
