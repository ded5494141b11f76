"""What the machine offers a gateway: cores and NUMA nodes (`topology`), who listens on a
port (`ports`). Standard library only.
"""
