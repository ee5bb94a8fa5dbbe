//! YCSB's workload property files (`-P FILE`, `-p key=value`): the Java properties syntax and
//! the core workload's keys, turned into a checked [`Settings`]. Pure: files are read by the
//! caller. Values are checked here, before any run starts; keys YCSB has but NAAM does not use
//! are named in warnings, never silently dropped.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use crate::ycsb::{Distribution, KeyNaming, Op, RecordShape, ScanLength, Workload, CORE_FILES};

/// Why a property set was refused.
#[derive(Debug, thiserror::Error, PartialEq)]
#[non_exhaustive]
pub enum PropertyError {
    /// A line of a property file is not `key=value`, `key: value` or `key value`.
    #[error("{source_name}:{line}: not a property (`key=value`): {text}")]
    Syntax {
        /// The file (or `-p`).
        source_name: String,
        /// 1-based line.
        line: usize,
        /// The line.
        text: String,
    },
    /// A value is not what its key takes.
    #[error("property {key}={value}: {reason}")]
    Value {
        /// The key.
        key: String,
        /// The value given.
        value: String,
        /// What the key takes.
        reason: String,
    },
}

/// Properties in the order they were given; a later value of a key replaces an earlier one.
#[derive(Clone, Debug, Default)]
pub struct Properties {
    values: BTreeMap<String, String>,
}

impl Properties {
    /// Reads Java properties text: `#` and `!` start comments, `=`, `:` or whitespace separate a
    /// key from its value, a trailing `\` continues a line.
    pub fn parse(text: &str, source_name: &str) -> Result<Properties, PropertyError> {
        let mut p = Properties::default();
        p.merge_text(text, source_name)?;
        Ok(p)
    }

    /// Adds the properties of `text` over these.
    pub fn merge_text(&mut self, text: &str, source_name: &str) -> Result<(), PropertyError> {
        let mut pending = String::new();
        let mut first_line = 0;
        for (i, raw) in text.lines().enumerate() {
            let line = raw.trim_start();
            if pending.is_empty() {
                if line.is_empty() || line.starts_with('#') || line.starts_with('!') {
                    continue;
                }
                first_line = i + 1;
            }
            // An odd number of trailing backslashes continues the line.
            let trailing = line.len() - line.trim_end_matches('\\').len();
            if trailing % 2 == 1 {
                pending.push_str(&line[..line.len() - 1]);
                continue;
            }
            pending.push_str(line);
            let logical = std::mem::take(&mut pending);
            self.set_line(&logical, source_name, first_line)?;
        }
        if !pending.is_empty() {
            self.set_line(&pending, source_name, first_line)?;
        }
        Ok(())
    }

    fn set_line(&mut self, line: &str, source_name: &str, at: usize) -> Result<(), PropertyError> {
        let split = line
            .find(['=', ':'])
            .or_else(|| line.find(char::is_whitespace));
        let (key, value) = match split {
            Some(i) => (&line[..i], &line[i + 1..]),
            None => (line, ""),
        };
        let key = key.trim();
        if key.is_empty() {
            return Err(PropertyError::Syntax {
                source_name: source_name.to_string(),
                line: at,
                text: line.to_string(),
            });
        }
        self.values
            .insert(key.to_string(), value.trim().to_string());
        Ok(())
    }

    /// Sets one property from `key=value` (`-p`).
    pub fn set_pair(&mut self, pair: &str) -> Result<(), PropertyError> {
        match pair.split_once('=') {
            Some((k, v)) if !k.trim().is_empty() => {
                self.values
                    .insert(k.trim().to_string(), v.trim().to_string());
                Ok(())
            }
            _ => Err(PropertyError::Syntax {
                source_name: "-p".into(),
                line: 1,
                text: pair.to_string(),
            }),
        }
    }

    /// Sets `key` to `value`.
    pub fn set(&mut self, key: &str, value: impl ToString) {
        self.values.insert(key.to_string(), value.to_string());
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.values.get(key).map(String::as_str)
    }

    /// Every key, sorted.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.values.keys().map(String::as_str)
    }
}

/// The keys [`Settings::from_properties`] reads.
pub const KNOWN_KEYS: [&str; 24] = [
    "workload",
    "recordcount",
    "operationcount",
    "readproportion",
    "updateproportion",
    "insertproportion",
    "scanproportion",
    "readmodifywriteproportion",
    "requestdistribution",
    "fieldcount",
    "fieldlength",
    "fieldlengthdistribution",
    "minscanlength",
    "maxscanlength",
    "scanlengthdistribution",
    "insertorder",
    "zeropadding",
    "threadcount",
    "target",
    "maxexecutiontime",
    "insertstart",
    "insertcount",
    "readallfields",
    "writeallfields",
];

/// Keys besides [`KNOWN_KEYS`] that NAAM reads: `status.interval` (seconds between status
/// lines, YCSB's name) and `naam.pipeline` (operations each client thread keeps in flight).
pub const NAAM_KEYS: [&str; 2] = ["status.interval", "naam.pipeline"];

/// YCSB's measurement and export keys NAAM honours ([`Measurement`]).
pub const MEASUREMENT_KEYS: [&str; 6] = [
    "measurementtype",
    "hdrhistogram.percentiles",
    "hdrhistogram.fileoutput",
    "hdrhistogram.output.path",
    "exportfile",
    "exporter",
];

/// YCSB keys that change nothing NAAM runs or reports (a table name, a histogram's bucket
/// count, the JVM's tracking, retry knobs of other stores, the hot set of a distribution NAAM
/// refuses anyway): accepted, and named once as ignored.
pub const IGNORED_KEYS: [&str; 14] = [
    "table",
    "columnfamily",
    "histogram.buckets",
    "timeseries.granularity",
    "measurement.interval",
    "measurement.trackjvm",
    "measurement.raw.output_file",
    "hotspotdatafraction",
    "hotspotopnfraction",
    "reportlatencyforeacherror",
    "latencytrackederrors",
    "core_workload_insertion_retry_limit",
    "core_workload_insertion_retry_interval",
    "dataintegrity",
];

/// How results are measured and written, from YCSB's keys.
#[derive(Clone, Debug, PartialEq)]
pub struct Measurement {
    /// Percentiles printed per operation (`hdrhistogram.percentiles`, default 95 and 99).
    pub percentiles: Vec<f64>,
    /// Where HdrHistogram interval logs go: the directory and the file names' prefix
    /// (`hdrhistogram.fileoutput=true` with `hdrhistogram.output.path`, as YCSB names them:
    /// `<path><OP>.hdr`).
    pub hdr_output: Option<PathBuf>,
    /// Where the final report goes instead of stdout (`exportfile`).
    pub export_file: Option<PathBuf>,
    /// In which form (`exporter`).
    pub exporter: Exporter,
}

/// YCSB's measurement exporters NAAM writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exporter {
    /// `site.ycsb.measurements.exporter.TextMeasurementsExporter` (default): `[OP], metric,
    /// value` lines.
    Text,
    /// `JSONArrayMeasurementsExporter`: one JSON array of `{metric, measurement, value}`.
    JsonArray,
}

/// A YCSB run as its properties describe it.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Operation mix, distributions and key naming.
    pub workload: Workload,
    /// Records the load phase inserts (and the run phase assumes).
    pub record_count: u64,
    /// Operations in the run phase; `None`: until `max_execution_time`.
    pub operation_count: Option<u64>,
    /// Record shape.
    pub shape: RecordShape,
    /// Client threads.
    pub threads: usize,
    /// Operations each client thread keeps in flight (`naam.pipeline`, default 1).
    pub pipeline: usize,
    /// Operations per second over all threads (`target`); `None`: as fast as possible.
    pub target_ops_per_sec: Option<f64>,
    /// The run (and load) phase stops after this long (`maxexecutiontime`).
    pub max_execution_time: Option<Duration>,
    /// First key number the load phase inserts (`insertstart`).
    pub insert_start: u64,
    /// Records this load inserts from `insert_start` (`insertcount`; default all).
    pub insert_count: u64,
    /// Updates write every field, not one (`writeallfields`).
    pub write_all_fields: bool,
    /// Time between status lines (`status.interval`, default 10 s).
    pub status_interval: Duration,
    /// How results are measured and written.
    pub measurement: Measurement,
    /// What was accepted but does not change a NAAM run, and keys nobody reads.
    pub warnings: Vec<String>,
}

fn bad(key: &str, value: &str, reason: impl Into<String>) -> PropertyError {
    PropertyError::Value {
        key: key.into(),
        value: value.into(),
        reason: reason.into(),
    }
}

impl Settings {
    /// Reads `p` over YCSB's CoreWorkload defaults (read 0.95, update 0.05, uniform requests,
    /// 10 fields of 100 bytes, scans up to 1000, hashed inserts).
    pub fn from_properties(p: &Properties) -> Result<Settings, PropertyError> {
        let int = |key: &str, default: u64, min: u64| -> Result<u64, PropertyError> {
            match p.get(key) {
                None => Ok(default),
                Some(v) => match v.parse::<u64>() {
                    Ok(n) if n >= min => Ok(n),
                    _ => Err(bad(key, v, format!("an integer of at least {min}"))),
                },
            }
        };
        let proportion = |key: &str, default: f64| -> Result<f64, PropertyError> {
            match p.get(key) {
                None => Ok(default),
                Some(v) => match v.parse::<f64>() {
                    Ok(x) if (0.0..=1.0).contains(&x) => Ok(x),
                    _ => Err(bad(key, v, "a proportion between 0 and 1")),
                },
            }
        };
        let boolean = |key: &str, default: bool| -> Result<bool, PropertyError> {
            match p.get(key) {
                None => Ok(default),
                Some("true") => Ok(true),
                Some("false") => Ok(false),
                Some(v) => Err(bad(key, v, "true or false")),
            }
        };
        let seconds = |key: &str| -> Result<Option<Duration>, PropertyError> {
            match p.get(key) {
                None => Ok(None),
                Some(v) => match v.parse::<f64>() {
                    Ok(s) if s > 0.0 && s <= 1e9 => Ok(Some(Duration::from_secs_f64(s))),
                    _ => Err(bad(key, v, "a number of seconds above 0")),
                },
            }
        };
        let mut warnings = Vec::new();
        if let Some(w) = p.get("workload") {
            if !w.ends_with("CoreWorkload") {
                return Err(bad(
                    "workload",
                    w,
                    "NAAM runs YCSB's core workload (site.ycsb.workloads.CoreWorkload)",
                ));
            }
        }
        let mix = [
            (Op::Read, proportion("readproportion", 0.95)?),
            (Op::Update, proportion("updateproportion", 0.05)?),
            (Op::Insert, proportion("insertproportion", 0.0)?),
            (Op::Scan, proportion("scanproportion", 0.0)?),
            (Op::Rmw, proportion("readmodifywriteproportion", 0.0)?),
        ];
        let total: f64 = mix.iter().map(|(_, x)| x).sum();
        if total <= 0.0 {
            return Err(bad(
                "readproportion",
                p.get("readproportion").unwrap_or("0"),
                "the five proportions add up to 0: no operation to run",
            ));
        }
        // YCSB's DiscreteGenerator draws in proportion to the weights: normalise.
        let mix = mix.map(|(op, x)| (op, x / total));
        let distribution = match p.get("requestdistribution").unwrap_or("uniform") {
            "uniform" => Distribution::Uniform,
            // CoreWorkload's "zipfian" is its scrambled zipfian generator.
            "zipfian" => Distribution::ScrambledZipfian,
            "latest" => Distribution::Latest,
            other => {
                return Err(bad(
                    "requestdistribution",
                    other,
                    "uniform, zipfian or latest (hotspot, sequential and exponential are not \
                     implemented)",
                ))
            }
        };
        let field_count = int("fieldcount", 10, 1)? as usize;
        let field_length = int("fieldlength", 100, 1)? as usize;
        match p.get("fieldlengthdistribution").unwrap_or("constant") {
            "constant" => {}
            other => {
                return Err(bad(
                    "fieldlengthdistribution",
                    other,
                    "constant (the only one implemented)",
                ))
            }
        }
        let min_scan = int("minscanlength", 1, 1)?;
        let max_scan = int("maxscanlength", 1000, 1)?;
        if min_scan > max_scan {
            return Err(bad(
                "minscanlength",
                &min_scan.to_string(),
                format!("at most maxscanlength ({max_scan})"),
            ));
        }
        let scan_length = match p.get("scanlengthdistribution").unwrap_or("uniform") {
            "uniform" => ScanLength::Uniform,
            "zipfian" => ScanLength::Zipfian,
            other => return Err(bad("scanlengthdistribution", other, "uniform or zipfian")),
        };
        let ordered = match p.get("insertorder").unwrap_or("hashed") {
            "hashed" => false,
            "ordered" => true,
            other => return Err(bad("insertorder", other, "hashed or ordered")),
        };
        let zero_padding = int("zeropadding", 1, 1)?;
        if zero_padding > 64 {
            return Err(bad(
                "zeropadding",
                &zero_padding.to_string(),
                "at most 64 digits",
            ));
        }
        let record_count = int("recordcount", 1000, 1)?;
        let operation_count = match p.get("operationcount") {
            None => Some(1000),
            Some(v) => match v.parse::<u64>() {
                Ok(n) if n >= 1 => Some(n),
                // YCSB: 0 operations with a time limit means "run until the time is up".
                Ok(0) if p.get("maxexecutiontime").is_some() => None,
                _ => {
                    return Err(bad(
                        "operationcount",
                        v,
                        "an integer of at least 1 (0 only with maxexecutiontime)",
                    ))
                }
            },
        };
        let threads = int("threadcount", 1, 1)?;
        if threads > 4096 {
            return Err(bad("threadcount", &threads.to_string(), "at most 4096"));
        }
        let pipeline = int("naam.pipeline", 1, 1)?;
        if pipeline > 1024 {
            return Err(bad("naam.pipeline", &pipeline.to_string(), "at most 1024"));
        }
        let target_ops_per_sec = match p.get("target") {
            None | Some("0") => None,
            Some(v) => match v.parse::<f64>() {
                Ok(t) if (0.001..=1e9).contains(&t) => Some(t),
                _ => {
                    return Err(bad(
                        "target",
                        v,
                        "operations per second from 0.001 to 10^9 (0: no limit)",
                    ))
                }
            },
        };
        let insert_start = int("insertstart", 0, 0)?;
        let insert_count = int("insertcount", record_count, 1)?;
        if insert_start.checked_add(insert_count).is_none() {
            return Err(bad(
                "insertcount",
                &insert_count.to_string(),
                "insertstart + insertcount overflows a key number",
            ));
        }
        if !boolean("readallfields", true)? {
            warnings.push(
                "readallfields=false: NAAM's stores read a record whole (one message); reads \
                 are measured as whole-record reads"
                    .to_string(),
            );
        }
        let write_all_fields = boolean("writeallfields", false)?;
        let status_interval = seconds("status.interval")?.unwrap_or(Duration::from_secs(10));
        let max_execution_time = seconds("maxexecutiontime")?;
        let measurement = measurement(p)?;
        let mut ignored = Vec::new();
        for key in p.keys() {
            if IGNORED_KEYS.contains(&key) {
                ignored.push(key);
            } else if !KNOWN_KEYS.contains(&key)
                && !NAAM_KEYS.contains(&key)
                && !MEASUREMENT_KEYS.contains(&key)
            {
                warnings.push(format!("unknown property `{key}` (ignored)"));
            }
        }
        if !ignored.is_empty() {
            ignored.sort_unstable();
            warnings.push(format!("ignored (not supported): {}", ignored.join(", ")));
        }
        Ok(Settings {
            workload: Workload {
                name: String::new(),
                mix,
                distribution,
                min_scan,
                max_scan,
                scan_length,
                naming: KeyNaming {
                    ordered,
                    zero_padding: zero_padding as usize,
                },
            },
            record_count,
            operation_count,
            shape: RecordShape {
                field_count,
                field_length,
            },
            threads: threads as usize,
            pipeline: pipeline as usize,
            target_ops_per_sec,
            max_execution_time,
            insert_start,
            insert_count,
            write_all_fields,
            status_interval,
            measurement,
            warnings,
        })
    }
}

impl Workload {
    /// YCSB's core workload `letter` (a-f), from the shipped file, read by these properties'
    /// rules (kept here, beside them: the generators in `ycsb` know nothing of files).
    pub fn core(letter: char) -> Option<Workload> {
        let letter = letter.to_ascii_lowercase();
        let (_, text) = CORE_FILES.iter().find(|(l, _)| *l == letter)?;
        let props = Properties::parse(text, "workload file").ok()?;
        let mut w = Settings::from_properties(&props).ok()?.workload;
        w.name = letter.to_string();
        Some(w)
    }
}

/// Reads YCSB's measurement and export keys: the measurement types whose output NAAM gives
/// (`histogram`, YCSB's default, and `hdrhistogram`, with or without `+histogram`: the same
/// percentile lines from an HdrHistogram), the percentiles, interval-log files and exporter.
/// Types whose output NAAM does not write (`raw`, `timeseries`) and exporters it lacks are
/// refused by name.
fn measurement(p: &Properties) -> Result<Measurement, PropertyError> {
    let kind = p.get("measurementtype").unwrap_or("histogram");
    let hdr = match kind {
        "histogram" => false,
        "hdrhistogram" | "hdrhistogram+histogram" => true,
        other => {
            return Err(bad(
                "measurementtype",
                other,
                "histogram or hdrhistogram (raw, timeseries and their mixes are not written)",
            ))
        }
    };
    let percentiles = match p.get("hdrhistogram.percentiles") {
        None => vec![95.0, 99.0],
        Some(list) => list
            .split(',')
            .map(|v| {
                v.trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|x| *x > 0.0 && *x < 100.0)
                    .ok_or_else(|| {
                        bad(
                            "hdrhistogram.percentiles",
                            list,
                            "comma-separated percentiles, each above 0 and below 100",
                        )
                    })
            })
            .collect::<Result<Vec<f64>, _>>()?,
    };
    let file_output = match p.get("hdrhistogram.fileoutput") {
        None | Some("false") => false,
        Some("true") => true,
        Some(other) => return Err(bad("hdrhistogram.fileoutput", other, "true or false")),
    };
    if file_output && !hdr {
        return Err(bad(
            "hdrhistogram.fileoutput",
            "true",
            "interval logs need measurementtype=hdrhistogram",
        ));
    }
    let hdr_output =
        file_output.then(|| PathBuf::from(p.get("hdrhistogram.output.path").unwrap_or("")));
    let exporter = match p.get("exporter") {
        None => Exporter::Text,
        Some(e) if e.ends_with("TextMeasurementsExporter") => Exporter::Text,
        Some(e) if e.ends_with("JSONArrayMeasurementsExporter") => Exporter::JsonArray,
        Some(e) => {
            return Err(bad(
                "exporter",
                e,
                "site.ycsb.measurements.exporter.TextMeasurementsExporter or \
                 JSONArrayMeasurementsExporter",
            ))
        }
    };
    Ok(Measurement {
        percentiles,
        hdr_output,
        export_file: p
            .get("exportfile")
            .filter(|f| !f.is_empty())
            .map(PathBuf::from),
        exporter,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// Any text is either properties or a syntax error; any properties are either settings
        /// or a value error: never a panic.
        #[test]
        fn hostile_files_get_answers(text in "[ -~\\n\\t=:#!\\\\]{0,400}") {
            if let Ok(p) = Properties::parse(&text, "f") {
                let _ = Settings::from_properties(&p);
            }
        }

        #[test]
        fn hostile_values_of_known_keys_get_answers(
            key in proptest::sample::select(KNOWN_KEYS.to_vec()),
            value in "[ -~]{0,24}",
        ) {
            let mut p = Properties::default();
            p.set(key, value);
            let _ = Settings::from_properties(&p);
        }
    }

    #[test]
    fn java_properties_syntax() {
        let p = Properties::parse(
            "# comment\n! also\n  recordcount=10\nfieldcount : 3\nworkload site.ycsb.workloads.CoreWorkload\n\
             long=a\\\n  b\n\n",
            "f",
        )
        .unwrap();
        assert_eq!(p.get("recordcount"), Some("10"));
        assert_eq!(p.get("fieldcount"), Some("3"));
        assert_eq!(p.get("workload"), Some("site.ycsb.workloads.CoreWorkload"));
        assert_eq!(p.get("long"), Some("ab"));
        assert!(matches!(
            Properties::parse("=x", "f"),
            Err(PropertyError::Syntax { line: 1, .. })
        ));
    }

    #[test]
    fn defaults_are_ycsb_core_workload_and_proportions_normalise() {
        let s = Settings::from_properties(&Properties::default()).unwrap();
        assert_eq!(s.record_count, 1000);
        assert_eq!(s.operation_count, Some(1000));
        assert_eq!(s.workload.distribution, Distribution::Uniform);
        assert_eq!(s.workload.max_scan, 1000);
        let mut p = Properties::default();
        p.set("readproportion", 1);
        p.set("updateproportion", 1);
        let s = Settings::from_properties(&p).unwrap();
        assert_eq!(s.workload.mix[0].1, 0.5);
    }

    #[test]
    fn bad_values_and_unknown_keys_are_named() {
        for (k, v) in [
            ("recordcount", "0"),
            ("recordcount", "-1"),
            ("readproportion", "1.5"),
            ("requestdistribution", "hotspot"),
            ("fieldlength", "x"),
            ("target", "-3"),
            ("maxexecutiontime", "0"),
            ("insertorder", "random"),
            ("operationcount", "0"),
            ("workload", "site.ycsb.workloads.RestWorkload"),
            ("measurementtype", "raw"),
            ("hdrhistogram.percentiles", "95,101"),
            ("exporter", "site.ycsb.measurements.exporter.XmlExporter"),
        ] {
            let mut p = Properties::default();
            p.set(k, v);
            let e = Settings::from_properties(&p).unwrap_err().to_string();
            assert!(e.contains(k) && e.contains(v), "{k}={v}: {e}");
        }
        let mut p = Properties::default();
        p.set("measurementtype", "hdrhistogram");
        p.set("table", "usertable");
        p.set("hotspotopnfraction", "0.8");
        p.set("nosuchkey", "1");
        let s = Settings::from_properties(&p).unwrap();
        assert!(
            !s.warnings.iter().any(|w| w.contains("measurementtype")),
            "{:?}",
            s.warnings
        );
        assert!(
            s.warnings
                .iter()
                .any(|w| w == "ignored (not supported): hotspotopnfraction, table"),
            "{:?}",
            s.warnings
        );
        assert!(s
            .warnings
            .iter()
            .any(|w| w.contains("unknown property `nosuchkey`")));
        p.set("operationcount", 0);
        p.set("maxexecutiontime", 5);
        assert_eq!(Settings::from_properties(&p).unwrap().operation_count, None);
    }
}
