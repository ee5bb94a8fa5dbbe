//! SVG line charts for the experiments (plotters' SVG backend; text laid out with ab_glyph from
//! the DejaVu Sans font that scripts/setup.sh installs).

use std::path::Path;
use std::sync::Once;

use anyhow::{bail, Context as _};
use plotters::prelude::*;

/// Where the font comes from (Debian's fonts-dejavu-core).
pub const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

fn register_font() -> anyhow::Result<()> {
    static ONCE: Once = Once::new();
    static mut RESULT: Option<String> = None;
    ONCE.call_once(|| {
        let r = std::fs::read(FONT)
            .map_err(|e| {
                format!("reading {FONT} (scripts/setup.sh installs fonts-dejavu-core): {e}")
            })
            .and_then(|bytes| {
                // plotters keeps registered fonts for the life of the process.
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
                    .map_err(|_| format!("{FONT} is not a usable font"))
            });
        // SAFETY: written once inside call_once, read only after it.
        unsafe { RESULT = r.err() };
    });
    // SAFETY: ONCE has completed; RESULT is never written again.
    match unsafe { (*std::ptr::addr_of!(RESULT)).clone() } {
        Some(e) => bail!(e),
        None => Ok(()),
    }
}

/// One line of a chart.
pub struct Series {
    /// Legend label.
    pub label: String,
    /// Points.
    pub points: Vec<(f64, f64)>,
}

/// Chart options.
pub struct Chart<'a> {
    /// Title.
    pub title: &'a str,
    /// X axis label.
    pub x_label: &'a str,
    /// Y axis label.
    pub y_label: &'a str,
    /// Logarithmic y axis.
    pub log_y: bool,
    /// Vertical markers (x, label), e.g. congestion start and end.
    pub markers: Vec<(f64, String)>,
}

/// Draws `series` as lines with points into an SVG file at `path`.
pub fn lines(path: &Path, chart: &Chart<'_>, series: &[Series]) -> anyhow::Result<()> {
    register_font()?;
    let pts = || series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in pts() {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if x0 > x1 {
        bail!("nothing to plot for {}", chart.title);
    }
    if x0 == x1 {
        x1 = x0 + 1.0;
    }
    if chart.log_y {
        y0 = y0.max(1e-3) / 1.5;
        y1 = y1.max(y0 * 10.0) * 1.5;
    } else {
        y0 = y0.min(0.0);
        y1 = if y1 <= y0 { y0 + 1.0 } else { y1 * 1.08 };
    }
    let root = SVGBackend::new(path, (960, 540)).into_drawing_area();
    root.fill(&WHITE).context("drawing")?;
    let colors = [BLUE, RED, GREEN, MAGENTA, CYAN, BLACK];
    macro_rules! draw {
        ($ctx:expr) => {{
            let mut ctx = $ctx;
            ctx.configure_mesh()
                .x_desc(chart.x_label)
                .y_desc(chart.y_label)
                .draw()
                .context("drawing axes")?;
            for (x, label) in &chart.markers {
                ctx.draw_series(std::iter::once(PathElement::new(
                    vec![(*x, y0), (*x, y1)],
                    BLACK.mix(0.4),
                )))
                .context("drawing a marker")?
                .label(label.as_str())
                .legend(|(lx, ly)| PathElement::new(vec![(lx, ly), (lx + 16, ly)], BLACK.mix(0.4)));
            }
            for (i, s) in series.iter().enumerate() {
                let c = colors[i % colors.len()];
                ctx.draw_series(LineSeries::new(s.points.iter().copied(), c.stroke_width(2)))
                    .context("drawing a series")?
                    .label(s.label.as_str())
                    .legend(move |(lx, ly)| {
                        PathElement::new(vec![(lx, ly), (lx + 16, ly)], c.stroke_width(2))
                    });
                if s.points.len() <= 40 {
                    ctx.draw_series(s.points.iter().map(|&p| Circle::new(p, 3, c.filled())))
                        .context("drawing points")?;
                }
            }
            ctx.configure_series_labels()
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .position(SeriesLabelPosition::UpperRight)
                .draw()
                .context("drawing the legend")?;
        }};
    }
    let mut builder = ChartBuilder::on(&root);
    builder
        .caption(chart.title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(70);
    if chart.log_y {
        draw!(builder
            .build_cartesian_2d(x0..x1, (y0..y1).log_scale())
            .context("building the chart")?);
    } else {
        draw!(builder
            .build_cartesian_2d(x0..x1, y0..y1)
            .context("building the chart")?);
    }
    root.present()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_an_svg() {
        if std::fs::metadata(FONT).is_err() {
            eprintln!("SKIPPED renders_an_svg: {FONT} missing (scripts/setup.sh installs fonts-dejavu-core)");
            return;
        }
        let dir = std::env::temp_dir().join(format!("naam-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.svg");
        let chart = Chart {
            title: "t",
            x_label: "x",
            y_label: "y",
            log_y: true,
            markers: vec![(1.5, "m".into())],
        };
        let s = vec![Series {
            label: "a".into(),
            points: vec![(1.0, 10.0), (2.0, 100.0)],
        }];
        lines(&path, &chart, &s).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        // Text is emitted as <text> elements with the content on its own line.
        assert!(
            svg.starts_with("<svg") && svg.contains("<polyline"),
            "{}",
            &svg[..200.min(svg.len())]
        );
        assert!(
            svg.lines().any(|l| l.trim() == "a"),
            "the legend names the series"
        );
    }
}
