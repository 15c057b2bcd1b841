#!/bin/bash
ls /sys/class/net > /app/interfaces.txt
