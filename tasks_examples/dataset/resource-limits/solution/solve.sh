#!/bin/bash
if [ -f /sys/fs/cgroup/memory.max ]; then
  bytes=$(cat /sys/fs/cgroup/memory.max)
else
  bytes=$(cat /sys/fs/cgroup/memory/memory.limit_in_bytes)
fi
echo $((bytes / 1024 / 1024)) > /app/memory.txt
