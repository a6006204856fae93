//! Access traces: every expert access of a run, in the order the expert buffer applied them, as
//! JSON lines (a header line, then one event per line). Replaying a trace through the same
//! policy and buffer size reproduces the run's hit counts exactly; replaying it through others
//! answers "what if".

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::policy::{LayerMap, Policy, Seeds};
use crate::atomic::AtomicFile;
use crate::error::{Error, Result};
use crate::ids::ExpertId;
use crate::ids::Stack;

pub const TRACE_VERSION: u32 = 1;

/// First line of a trace file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceHeader {
    pub edgemoe_trace: u32,
    /// Buffer size and policy of the recorded run.
    pub slots: usize,
    pub policy: Policy,
    pub prefetch: bool,
    pub layers: LayerMap,
    /// What calibration measured of each expert (seeds of the `lfu`/`edgemoe` counts): the
    /// keys `seeds` (activation frequencies) and `pass_seeds` (absent without pass counts).
    #[serde(flatten)]
    pub seeds: Seeds,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AccessKind {
    /// The model needed the expert now.
    Demand,
    /// A load started ahead of need (dictionary prediction or the next expert of a layer).
    Prefetch,
    /// A prefetch dropped before it was used (its slot freed).
    Cancel,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceEvent {
    /// Decoder steps done before this access (the encoder pass shares the next step's number).
    pub token: u64,
    pub kind: AccessKind,
    pub stack: Stack,
    /// Block index inside the stack.
    pub layer: u16,
    pub expert: u16,
    /// Decoder MoE layer executing (absent while the encoder runs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current: Option<u16>,
    /// Experts that could not be evicted at this moment (being computed on or being read).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pinned: Vec<ExpertId>,
    /// A demand access that waited for expert bytes: milliseconds the compute thread waited
    /// (its own read, a read in flight, or a slot to free). Over a run they add up to the
    /// run's `stall_ms`. Absent for an access that did not wait, and for other kinds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waited_ms: Option<f64>,
}

impl TraceEvent {
    pub fn id(&self) -> ExpertId {
        ExpertId {
            stack: self.stack,
            layer: self.layer,
            expert: self.expert,
        }
    }
}

/// Writes a trace under a temporary name ([`crate::atomic`]); [`TraceWriter::finish`] puts it
/// in place, so a run that fails leaves no half trace.
pub struct TraceWriter {
    path: PathBuf,
    out: AtomicFile,
}

impl TraceWriter {
    pub fn create(path: &Path, header: &TraceHeader) -> Result<Self> {
        let mut writer = TraceWriter {
            path: path.to_path_buf(),
            out: AtomicFile::create(path)?,
        };
        writer.line(header)?;
        Ok(writer)
    }

    fn line<T: Serialize>(&mut self, value: &T) -> Result<()> {
        serde_json::to_writer(&mut self.out, value)
            .map_err(|e| Error::format(&self.path, e.to_string()))?;
        self.out
            .write_all(b"\n")
            .map_err(|e| Error::io(&self.path, e))
    }

    pub fn event(&mut self, event: &TraceEvent) -> Result<()> {
        self.line(event)
    }

    pub fn finish(self) -> Result<()> {
        self.out.commit()
    }
}

/// Reads a whole trace, naming the line of any malformed entry.
pub fn read_trace(path: &Path) -> Result<(TraceHeader, Vec<TraceEvent>)> {
    let file = crate::io::open_input_file(path)?;
    let mut lines = BufReader::new(file).lines();
    let first = lines
        .next()
        .ok_or_else(|| Error::format(path, "empty trace file"))?
        .map_err(|e| Error::io(path, e))?;
    let header: TraceHeader = serde_json::from_str(&first)
        .map_err(|e| Error::format(path, format!("line 1: not an edgemoe trace header: {e}")))?;
    if header.edgemoe_trace != TRACE_VERSION {
        return Err(Error::format(
            path,
            format!(
                "trace version {}, this engine reads version {TRACE_VERSION}",
                header.edgemoe_trace
            ),
        ));
    }
    let mut events = Vec::new();
    for (i, line) in lines.enumerate() {
        let line = line.map_err(|e| Error::io(path, e))?;
        if line.trim().is_empty() {
            continue;
        }
        let event: TraceEvent = serde_json::from_str(&line)
            .map_err(|e| Error::format(path, format!("line {}: {e}", i + 2)))?;
        check_layers(&header.layers, &event)
            .map_err(|e| Error::format(path, format!("line {}: {e}", i + 2)))?;
        events.push(event);
    }
    Ok((header, events))
}

/// Fails unless every layer `event` names is an MoE block of its stack in `layers` (the
/// header's map), and its executing decoder layer one of the decoder's MoE layers: an access to
/// a block the model does not have would be replayed as an expert of its own.
fn check_layers(layers: &LayerMap, event: &TraceEvent) -> std::result::Result<(), String> {
    for id in std::iter::once(event.id()).chain(event.pinned.iter().copied()) {
        if layers.moe_index(id.stack, usize::from(id.layer)).is_none() {
            return Err(format!(
                "{:?} block {} is not one of the header's MoE blocks of that stack ({:?})",
                id.stack,
                id.layer,
                layers.blocks(id.stack)
            ));
        }
    }
    if let Some(current) = event.current {
        if usize::from(current) >= layers.decoder_layers() {
            return Err(format!(
                "executing decoder MoE layer {current}, but the header has {} decoder MoE layers",
                layers.decoder_layers()
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> TraceHeader {
        TraceHeader {
            edgemoe_trace: TRACE_VERSION,
            slots: 4,
            policy: Policy::Lru,
            prefetch: false,
            layers: LayerMap {
                encoder_moe_blocks: vec![1, 3],
                decoder_moe_blocks: vec![1],
            },
            seeds: Seeds::default(),
        }
    }

    fn demand(stack: Stack, layer: u16, expert: u16) -> TraceEvent {
        TraceEvent {
            token: 0,
            kind: AccessKind::Demand,
            stack,
            layer,
            expert,
            current: None,
            pinned: Vec::new(),
            waited_ms: None,
        }
    }

    /// Writes a trace of `events` and reads it back.
    fn round_trip(events: &[TraceEvent]) -> Result<(TraceHeader, Vec<TraceEvent>)> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("trace.jsonl");
        let mut writer = TraceWriter::create(&path, &header()).unwrap();
        for event in events {
            writer.event(event).unwrap();
        }
        writer.finish().unwrap();
        read_trace(&path)
    }

    #[test]
    fn events_on_blocks_the_header_does_not_have_are_refused_by_line() {
        let good = demand(Stack::Encoder, 3, 7);
        let decoding = TraceEvent {
            current: Some(0),
            pinned: vec![good.id()],
            ..demand(Stack::Decoder, 1, 0)
        };
        let (_, events) = round_trip(&[good.clone(), decoding.clone()]).unwrap();
        assert_eq!(events, [good.clone(), decoding.clone()]);

        let not_moe = demand(Stack::Encoder, 2, 0);
        let far = demand(Stack::Decoder, 65535, 0);
        let pinned = TraceEvent {
            pinned: vec![not_moe.id()],
            ..good.clone()
        };
        let executing = TraceEvent {
            current: Some(1),
            ..decoding.clone()
        };
        for (bad, needle) in [
            (
                not_moe,
                "Encoder block 2 is not one of the header's MoE blocks",
            ),
            (far, "Decoder block 65535"),
            (pinned, "Encoder block 2"),
            (executing, "executing decoder MoE layer 1"),
        ] {
            let err = round_trip(&[good.clone(), bad]).unwrap_err().to_string();
            assert!(err.contains("line 3") && err.contains(needle), "{err}");
        }
    }
}
