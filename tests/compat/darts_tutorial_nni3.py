"""NNI 3.0's tutorial "Searching in DARTS search space" (microsoft/nni, examples/tutorials/darts.py,
published as docs/source/tutorials/darts.py), condensed: its code cells in order with the prose
and the graphviz drawing of the cells left out (plot_double_cells is replaced by a check of the
keys it reads). Changed lines are marked: imports (`# changed import`), the data (`# changed data`:
torchvision is not installed and nothing is downloaded, so CIFAR-10 is a stand-in of the same
form -- 3x32x32 images of 10 classes -- made of Fashion-MNIST images padded and repeated over three
channels), and the settings the tutorial itself names for a machine without a GPU
(`# changed: no GPU`: gpus=0, cuda=False) or for offline use (`# changed: no download`).
The tutorial's last part runs as written: its custom LightningModule (SGD with a cosine schedule,
an auxiliary loss, drop path) drives the weights of the DARTS supernet under a Lightning Trainer
(``DartsStrategy(gradient_clip_val=5.)``), then retrains the final model (``evaluator.fit``).
"""

import numpy as np
import torch
from torch.utils.data import Dataset, SubsetRandomSampler

import tridens.compat.nni as nni  # changed import
from tridens.compat.nni.nas.evaluator.pytorch import DataLoader  # changed import
from tridens.datasets import fashion_mnist  # changed data

CIFAR_MEAN = [0.49139968, 0.48215827, 0.44653124]
CIFAR_STD = [0.24703233, 0.24348505, 0.26158768]


class CIFAR10(Dataset):  # changed data: a CIFAR-10-shaped stand-in (3x32x32 images, 10 classes), offline
    def __init__(self, root, train, download, transform=None):
        train_part, valid_part = fashion_mnist(limit=384, val_limit=128)
        x, self.targets = (train_part if train else valid_part).tensors
        x = torch.nn.functional.pad(x, (2, 2, 2, 2)).repeat(1, 3, 1, 1)
        self.data = (x - torch.tensor(CIFAR_MEAN).view(3, 1, 1)) / torch.tensor(CIFAR_STD).view(3, 1, 1)
        self.transform = transform

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        image = self.data[i]
        return (self.transform(image) if self.transform else image), self.targets[i]


transform_valid = None  # changed data: normalized by the stand-in (torchvision.transforms is not installed)
valid_data = nni.trace(CIFAR10)(root='./data', train=False, download=True, transform=transform_valid)
valid_loader = DataLoader(valid_data, batch_size=256, num_workers=6)

from tridens.compat.nni.nas.hub.pytorch import DARTS as DartsSpace  # changed import

darts_v2_model = DartsSpace.load_searched_model('darts-v2', pretrained=False, download=True)  # changed: no download


def evaluate_model(model, cuda=False):
    device = torch.device('cuda' if cuda else 'cpu')
    model.to(device)
    model.eval()
    with torch.no_grad():
        correct = total = 0
        for inputs, targets in valid_loader:
            inputs, targets = inputs.to(device), targets.to(device)
            logits = model(inputs)
            _, predict = torch.max(logits, 1)
            correct += (predict == targets).sum().cpu().item()
            total += targets.size(0)
    print('Accuracy:', correct / total)
    return correct / total


evaluate_model(darts_v2_model, cuda=False)  # changed: no GPU

model_space = DartsSpace(
    width=16,           # the initial filters (channel number) for the model
    num_cells=8,        # the number of stacked cells in total
    dataset='cifar'     # to give a hint about input resolution, here is 32x32
)

fast_dev_run = True

from tridens.compat.nni.nas.evaluator.pytorch import Classification  # changed import

transform = None  # changed data: no random crop / flip (torchvision.transforms is not installed)

train_data = nni.trace(CIFAR10)(root='./data', train=True, download=True, transform=transform)

num_samples = len(train_data)
indices = np.random.permutation(num_samples)
split = num_samples // 2

search_train_loader = DataLoader(
    train_data, batch_size=64, num_workers=6,
    sampler=SubsetRandomSampler(indices[:split]),
)

search_valid_loader = DataLoader(
    train_data, batch_size=64, num_workers=6,
    sampler=SubsetRandomSampler(indices[split:]),
)

evaluator = Classification(
    learning_rate=1e-3,
    weight_decay=1e-4,
    train_dataloaders=search_train_loader,
    val_dataloaders=search_valid_loader,
    max_epochs=10,
    gpus=0,  # changed: no GPU
    fast_dev_run=fast_dev_run,
)

from tridens.compat.nni.nas.strategy import DARTS as DartsStrategy  # changed import

strategy = DartsStrategy()

from tridens.compat.nni.nas.experiment import NasExperiment  # changed import

experiment = NasExperiment(model_space, evaluator, strategy)
experiment.run()

exported_arch = experiment.export_top_models(formatter='dict')[0]

print('exported_arch:', exported_arch)


def plot_single_cell(arch_dict, cell_name):  # the keys and values the tutorial's drawing reads
    for i in range(2, 6):
        for j in range(2):
            op = arch_dict[f'{cell_name}/op_{i}_{j}']
            from_ = arch_dict[f'{cell_name}/input_{i}_{j}']
            assert isinstance(op, str) and from_ in range(i), (op, from_)


def plot_double_cells(arch_dict):
    plot_single_cell(arch_dict, 'normal')
    plot_single_cell(arch_dict, 'reduce')


plot_double_cells(exported_arch)

from tridens.compat.nni.nas.space import model_context  # changed import

with model_context(exported_arch):
    final_model = DartsSpace(width=16, num_cells=8, dataset='cifar')

train_loader = DataLoader(train_data, batch_size=96, num_workers=6)  # Use the original training data

max_epochs = 100

evaluator = Classification(
    learning_rate=1e-3,
    weight_decay=1e-4,
    train_dataloaders=train_loader,
    val_dataloaders=valid_loader,
    max_epochs=max_epochs,
    gpus=0,  # changed: no GPU
    export_onnx=False,          # Disable ONNX export for this experiment
    fast_dev_run=fast_dev_run   # Should be false for fully training
)

print('retrained:', evaluator.fit(final_model))

# The tutorial's "Reproduce results in DARTS paper": a custom LightningModule, run by PyTorch Lightning.
from tridens.compat.nni.nas.evaluator.pytorch import ClassificationModule  # changed import


class DartsClassificationModule(ClassificationModule):
    def __init__(
        self,
        learning_rate: float = 0.001,
        weight_decay: float = 0.,
        auxiliary_loss_weight: float = 0.4,
        max_epochs: int = 600
    ):
        self.auxiliary_loss_weight = auxiliary_loss_weight
        # Training length will be used in LR scheduler
        self.max_epochs = max_epochs
        super().__init__(learning_rate=learning_rate, weight_decay=weight_decay, export_onnx=False)

    def configure_optimizers(self):
        """Customized optimizer with momentum, as well as a scheduler."""
        optimizer = torch.optim.SGD(
            self.parameters(),
            momentum=0.9,
            lr=self.hparams.learning_rate,
            weight_decay=self.hparams.weight_decay
        )
        return {
            'optimizer': optimizer,
            'lr_scheduler': torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, self.max_epochs, eta_min=1e-3)
        }

    def training_step(self, batch, batch_idx):
        """Training step, customized with auxiliary loss."""
        x, y = batch
        if self.auxiliary_loss_weight:
            y_hat, y_aux = self(x)
            loss_main = self.criterion(y_hat, y)
            loss_aux = self.criterion(y_aux, y)
            self.log('train_loss_main', loss_main)
            self.log('train_loss_aux', loss_aux)
            loss = loss_main + self.auxiliary_loss_weight * loss_aux
        else:
            y_hat = self(x)
            loss = self.criterion(y_hat, y)
        self.log('train_loss', loss, prog_bar=True)
        for name, metric in self.metrics.items():
            self.log('train_' + name, metric(y_hat, y), prog_bar=True)
        return loss

    def on_train_epoch_start(self):
        # Set drop path probability before every epoch. This has no effect if drop path is not enabled in model.
        self.model.set_drop_path_prob(self.model.drop_path_prob * self.current_epoch / self.max_epochs)

        # Logging learning rate at the beginning of every epoch
        self.log('lr', self.trainer.optimizers[0].param_groups[0]['lr'])


from tridens.compat.nni.nas.evaluator.pytorch import Lightning, Trainer  # changed import

max_epochs = 50

evaluator = Lightning(
    DartsClassificationModule(0.025, 3e-4, 0., max_epochs),
    Trainer(
        gpus=0,  # changed: no GPU
        max_epochs=max_epochs,
        fast_dev_run=fast_dev_run,
    ),
    train_dataloaders=search_train_loader,
    val_dataloaders=search_valid_loader
)

strategy = DartsStrategy(gradient_clip_val=5.)

model_space = DartsSpace(width=16, num_cells=8, dataset='cifar')

experiment = NasExperiment(model_space, evaluator, strategy)
experiment.run()

exported_arch = experiment.export_top_models(formatter='dict')[0]

print('lightning exported_arch:', exported_arch)

plot_double_cells(exported_arch)  # the tutorial draws a fixed architecture here; the keys are the same

with model_context(exported_arch):
    final_model = DartsSpace(width=36, num_cells=20, dataset='cifar', auxiliary_loss=True, drop_path_prob=0.2)

max_epochs = 600

train_loader_cutout = train_loader  # changed data: no cutout transform (torchvision.transforms is not installed)

evaluator = Lightning(
    DartsClassificationModule(0.025, 3e-4, 0.4, max_epochs),
    trainer=Trainer(
        gpus=0,  # changed: no GPU
        gradient_clip_val=5.,
        max_epochs=max_epochs,
        fast_dev_run=fast_dev_run
    ),
    train_dataloaders=train_loader_cutout,
    val_dataloaders=valid_loader,
)

print('final retrained:', evaluator.fit(final_model))
