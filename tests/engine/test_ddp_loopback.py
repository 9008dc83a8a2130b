"""The DDP rendezvous of ``allocation=`` listens on 127.0.0.1 only: two real ranks meet, and
every socket their processes listen on is a loopback one."""

import multiprocessing as mp

import psutil


def _rank(rank: int, world: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    from tridens.executors._ddp import close_group, init_group

    init_group(rank, world, port, timeout=60)
    total = torch.ones(1)
    dist.all_reduce(total)  # the group works, with every rank's sockets open
    me = psutil.Process()
    queue.put((rank, float(total), sorted({(c.laddr.ip, c.laddr.port) for c in me.net_connections("inet")
                                           if c.status == psutil.CONN_LISTEN})))
    dist.barrier()
    close_group()


def test_the_rendezvous_and_gloo_listen_on_loopback_only():
    from tridens.executors._ddp import free_port

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    ranks = [ctx.Process(target=_rank, args=(r, 2, port, queue)) for r in range(2)]
    for p in ranks:
        p.start()
    results = sorted(queue.get(timeout=120) for _ in ranks)
    for p in ranks:
        p.join(60)
    assert [(rank, total) for rank, total, _ in results] == [(0, 2.0), (1, 2.0)]
    listening = [address for _, _, addresses in results for address in addresses]
    assert any(port == p for _, p in listening)  # rank 0 serves the rendezvous
    assert all(ip in ("127.0.0.1", "::1") for ip, _ in listening), listening
