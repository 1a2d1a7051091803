"""How loraflow's processes start: the `loraflow` command, the local launcher, systemd units, example configs."""
