#!/bin/bash
# The limits come from task.toml: memory_mb = 256 and cpus = 1.
if [ -f /sys/fs/cgroup/cpu.max ]; then
  quota=$(cut -d' ' -f1 /sys/fs/cgroup/cpu.max); period=$(cut -d' ' -f2 /sys/fs/cgroup/cpu.max)
else
  quota=$(cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us); period=$(cat /sys/fs/cgroup/cpu/cpu.cfs_period_us)
fi
echo "memory.txt=$(cat /app/memory.txt 2>/dev/null) cpu quota=$quota period=$period"
if [ "$(cat /app/memory.txt 2>/dev/null)" = "256" ] && [ "$quota" = "$period" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
