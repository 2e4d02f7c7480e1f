"""nnterp's FactoredMatrix against TransformerLens 3.9's own, on the same factors (the Main Demo's circuits section:
model.OV, products, svd, eigenvalues, norm, get_corner, indexing)."""

from __future__ import annotations

import pytest
import torch
from transformer_lens import FactoredMatrix as Theirs

from nnterp.compat.transformer_lens.factored import FactoredMatrix

from .tl_models import pair


def close(a, b, atol=1e-4):
    torch.testing.assert_close(torch.as_tensor(a).float(), torch.as_tensor(b).float(), atol=atol, rtol=1e-4)


def same(ours: FactoredMatrix, theirs: Theirs):
    assert isinstance(ours, FactoredMatrix) and tuple(ours.shape) == tuple(theirs.shape)
    assert (ours.ldim, ours.mdim, ours.rdim) == (theirs.ldim, theirs.mdim, theirs.rdim)
    close(ours.AB, theirs.AB)


@pytest.fixture(scope="module")
def factors():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(3, 2, 8, 3, generator=generator), torch.randn(3, 2, 3, 8, generator=generator)


def test_products_transposes_and_scalars(factors):
    A, B = factors
    ours, theirs = FactoredMatrix(A, B), Theirs(A, B)
    same(ours, theirs)
    close(ours.BA, theirs.BA)
    same(ours.T, theirs.T)
    wide, narrow, vector = torch.randn(8, 5), torch.randn(8, 2), torch.randn(8)
    for other in (wide, narrow):
        same(ours @ other, theirs @ other)
        same(other.T @ ours, other.T @ theirs)
    close(ours @ vector, theirs @ vector)
    close(vector @ ours, vector @ theirs)
    same(ours @ FactoredMatrix(B[0, 0].T, A[0, 0].T), theirs @ Theirs(B[0, 0].T, A[0, 0].T))
    same(ours * 2.5, theirs * 2.5)
    same(2.5 * ours, 2.5 * theirs)


def test_svd_eigenvalues_norm_and_corner(factors):
    A, B = factors
    ours, theirs = FactoredMatrix(A, B), Theirs(A, B)
    U, S, V = ours.svd()
    close(S, theirs.S)
    close(U @ torch.diag_embed(S) @ V.transpose(-2, -1), theirs.AB)  # the vectors up to their signs
    close(U.abs(), theirs.U.abs(), atol=1e-3)
    close(V.abs(), theirs.V.abs(), atol=1e-3)
    close(ours.norm(), theirs.norm())
    close(ours.norm(), ours.AB.pow(2).sum((-2, -1)).sqrt())
    ours_eig, theirs_eig = ours.eigenvalues, theirs.eigenvalues
    key = lambda e: (e.real * 1e3).round() * 1e6 + e.imag  # noqa: E731 - one order for both
    close(torch.view_as_real(ours_eig.flatten()[key(ours_eig.flatten()).argsort()]),
          torch.view_as_real(theirs_eig.flatten()[key(theirs_eig.flatten()).argsort()]))
    close(ours.get_corner(2), theirs.get_corner(2))
    close(ours.make_even().AB, theirs.AB)
    close(ours.collapse_l().abs(), theirs.collapse_l().abs(), atol=1e-3)
    close(ours.collapse_r().abs(), theirs.collapse_r().abs(), atol=1e-3)
    same(ours.unsqueeze(0), theirs.unsqueeze(0))


@pytest.mark.parametrize("index", [1, (1, 0), (2, 1, 3), (0, 1, slice(2, 5), -1), (0, 0, -1, 2), (slice(None), 1)])
def test_indexing(factors, index):
    A, B = factors
    same(FactoredMatrix(A, B)[index], Theirs(A, B)[index])


def test_the_models_qk_and_ov_circuits(gpt2_tokenizer_dir):
    _, ours, theirs = pair("gpt2", gpt2_tokenizer_dir)
    for name in ("QK", "OV"):
        mine, tl = getattr(ours, name), getattr(theirs, name)
        same(mine, tl)
        close(mine[1, 2].S, tl[1, 2].S)
        close(mine.norm(), tl.norm())
    ov = ours.OV[0, 1]
    full = ours.W_E[:50] @ ov @ ours.W_U[:, :50]  # the Main Demo's full OV circuit, factored
    close(full.AB, (theirs.W_E[:50] @ theirs.OV[0, 1] @ theirs.W_U[:, :50]).AB)
