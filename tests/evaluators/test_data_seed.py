"""The data order and augmentation follow ``data_seed``, shared by trials; init and dropout follow the trial seed."""

import torch

import tridens as td


def _config(digit_images, **kw):
    train, val = digit_images
    return td.evaluators.Classification(train=train, val=val, epochs=1, batch_size=32, **kw).config({})


def test_trials_share_data_order_by_default(digit_images):
    cfg = _config(digit_images)
    assert torch.equal(cfg.epoch_order(seed=1, epoch=0), cfg.epoch_order(seed=2, epoch=0))
    assert not torch.equal(cfg.epoch_order(seed=1, epoch=0), cfg.epoch_order(seed=1, epoch=1))
    own = _config(digit_images, data_seed=None)
    assert not torch.equal(own.epoch_order(seed=1, epoch=0), own.epoch_order(seed=2, epoch=0))


def test_augmentation_randomness_follows_the_data_seed(digit_images):
    def jitter(x):
        return x + 0.1 * torch.randn_like(x)

    cfg = _config(digit_images, transforms=jitter)
    x = digit_images[0].tensors[0][:8]
    torch.manual_seed(123)
    a = cfg.augment(x, seed=1, epoch=0, batch=3)
    state = torch.get_rng_state()
    b = cfg.augment(x, seed=2, epoch=0, batch=3)
    assert torch.equal(a, b)                       # the same batch is augmented alike for every trial
    assert torch.equal(state, torch.get_rng_state())  # the caller's random stream is untouched
    assert not torch.equal(a, cfg.augment(x, seed=1, epoch=0, batch=4))
    assert not torch.equal(a, _config(digit_images, transforms=jitter, data_seed=5).augment(x, seed=1, epoch=0, batch=3))
