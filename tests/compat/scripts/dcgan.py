"""DCGAN in the style of DeepSpeedExamples' training/gan/gan_deepspeed_train.py: two engines
built from client Adam optimizers, forward through the raw modules, the discriminator's real
and fake losses backwarded separately before one step, the generator's loss backwarded
through the discriminator. A tiny stand-in dataset of 8x8 images is made in code."""

import argparse
import json

import deepspeed
import torch
import torch.nn as nn


def get_argument_parser():
    parser = argparse.ArgumentParser(description="DCGAN")
    parser.add_argument("--batchSize", type=int, default=4, help="input batch size")
    parser.add_argument("--nz", type=int, default=4, help="size of the latent z vector")
    parser.add_argument("--ngf", type=int, default=4)
    parser.add_argument("--ndf", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=1, help="number of epochs to train for")
    parser.add_argument("--lr", type=float, default=0.0002, help="learning rate")
    parser.add_argument("--beta1", type=float, default=0.5, help="beta1 for adam")
    parser.add_argument("--manualSeed", type=int, default=999, help="manual seed")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--loss_file", type=str, default=None)
    return parser


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        torch.nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        torch.nn.init.normal_(m.weight, 1.0, 0.02)
        torch.nn.init.zeros_(m.bias)


class Generator(nn.Module):
    def __init__(self, ngf, nc, nz):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 2, 4, 1, 0, bias=False),  # 4x4
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, nc, 4, 2, 1, bias=False),  # 8x8
            nn.Tanh(),
        )

    def forward(self, x):
        return self.main(x)


class Discriminator(nn.Module):
    def __init__(self, ndf, nc):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False),  # 4x4
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, 1, 4, 1, 0, bias=False),  # 1x1
            nn.Sigmoid(),
        )

    def forward(self, x):
        return self.main(x).view(-1, 1).squeeze(1)


def get_dataset(rank, n=16):
    g = torch.Generator().manual_seed(500 + rank)
    return torch.utils.data.TensorDataset(torch.rand(n, 3, 8, 8, generator=g) * 2 - 1), 3


def train(args):
    torch.manual_seed(args.manualSeed)
    rank = torch.distributed.get_rank()
    dataset, nc = get_dataset(rank)
    dataloader = torch.utils.data.DataLoader(dataset, batch_size=args.batchSize, shuffle=False)
    device = torch.device("cpu")
    nz, ngf, ndf = int(args.nz), int(args.ngf), int(args.ndf)
    netG = Generator(ngf, nc, nz).to(device)
    netG.apply(weights_init)
    netD = Discriminator(ndf, nc).to(device)
    netD.apply(weights_init)
    criterion = nn.BCELoss()
    real_label, fake_label = 1, 0
    optimizerD = torch.optim.Adam(netD.parameters(), lr=args.lr, betas=(args.beta1, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=args.lr, betas=(args.beta1, 0.999))
    model_engineD, optimizerD, _, _ = deepspeed.initialize(
        args=args, model=netD, model_parameters=netD.parameters(), optimizer=optimizerD
    )
    model_engineG, optimizerG, _, _ = deepspeed.initialize(
        args=args, model=netG, model_parameters=netG.parameters(), optimizer=optimizerG
    )
    g = torch.Generator().manual_seed(900 + rank)
    losses = []
    for epoch in range(args.epochs):
        for i, data in enumerate(dataloader, 0):
            # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
            netD.zero_grad()
            real = data[0].to(device)
            batch_size = real.size(0)
            label = torch.full((batch_size,), real_label, dtype=real.dtype, device=device)
            output = netD(real)
            errD_real = criterion(output, label)
            model_engineD.backward(errD_real)
            noise = torch.randn(batch_size, nz, 1, 1, generator=g).to(device)
            fake = netG(noise)
            label.fill_(fake_label)
            output = netD(fake.detach())
            errD_fake = criterion(output, label)
            model_engineD.backward(errD_fake)
            errD = errD_real + errD_fake
            model_engineD.step()
            # (2) Update G network: maximize log(D(G(z)))
            netG.zero_grad()
            label.fill_(real_label)
            output = netD(fake)
            errG = criterion(output, label)
            model_engineG.backward(errG)
            model_engineG.step()
            losses.append([errD.item(), errG.item()])
            print(
                f"[{epoch}/{args.epochs}][{i}/{len(dataloader)}] Loss_D: {errD.item():.4f} Loss_G: {errG.item():.4f}"
            )
    return losses


def main():
    parser = get_argument_parser()
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed()
    losses = train(args)
    if args.loss_file and torch.distributed.get_rank() == 0:
        with open(args.loss_file, "w") as f:
            json.dump(losses, f)


if __name__ == "__main__":
    main()
