#!/bin/bash
# Runs in [environment].workdir, not the image WORKDIR (/).
echo "$GREETING" > greeting.txt
