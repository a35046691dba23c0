"""bench.plan_check's step modes (2 gloo ranks): the mode that skips the check's work
posts no exchange, the three with the check post one each step (the C++ one in C++,
the Python ones in Python), and the shipped kernels are back after them. (Since a steady
step's check stopped calling ``host_group.of`` (733abea), the earlier "patched out" mode,
which made that return None, left every steady step's exchange in place: it compared
the check with itself.)"""

from ddp_fusion.launch import run_ranks

from _workers_probes import plan_check_modes


def test_the_skipped_mode_posts_no_exchange_and_the_others_one_per_step():
    for in_flight, steady in run_ranks(plan_check_modes, world_size=2, timeout=120):
        # round 0 runs: C++ check, Python check, check's work skipped, Python check and
        # ops timed; then a step on the kernels as they ship
        assert in_flight == [1, 1, 1, 1, 0, 0, 1, 1, 1]
        # the C++ kernels ran the C++ mode's two steps, and no other (the Python modes
        # turn them off; the last step, the first after, runs the Python ops again)
        assert steady == (2, 2)
