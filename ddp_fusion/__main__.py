"""``python -m ddp_fusion``: the fused training demo (see ddp_fusion/demo.py)."""

from ddp_fusion.demo import main

if __name__ == "__main__":
    main()
