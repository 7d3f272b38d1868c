import torch

from pp_lab.bench.bottleneck_init import grad_energy
from pp_lab.bottleneck import fixed_basis, orthonormal


def test_the_identity_passes_all_of_the_gradient_back():
    g = torch.randn(64, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert grad_energy(fixed_basis(8, 8, "identity", 0), g.T @ g) == 1.0


def test_an_orthonormal_basis_passes_back_the_gradient_in_its_span():
    grad = torch.diag(torch.tensor([3.0, 1.0, 0.0], dtype=torch.float64))  # sum g g^T: energy 3 along e0, 1 along e1
    assert grad_energy(orthonormal(torch.zeros(3), torch.eye(3)[:, :1]), grad) == 0.75
    assert grad_energy(orthonormal(torch.zeros(3), torch.eye(3)[:, 1:]), grad) == 0.25
