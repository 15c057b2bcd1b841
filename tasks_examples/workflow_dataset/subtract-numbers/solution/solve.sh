#!/bin/bash
echo 42 > /logs/artifacts/answer.txt
